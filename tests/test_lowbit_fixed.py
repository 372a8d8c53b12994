"""The ``dense`` kernel's softmax against a fixed reference (``FIX``, :data:`kvweave.kernels.lowbit_dense.DENSE_FIXED_MAX`):
each program's probabilities are taken against its first step's largest logit instead of a running maximum, and a
program whose logits rose more than ``DENSE_FIXED_LIMIT`` (base 2) above it runs again against the largest it saw.
Under Triton's interpreter against the torch twin, with the online softmax beside it."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import lowbit_dense as ld
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

from test_lowbit_dense import _post_rope_view
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


@pytest.mark.interpreter
@pytest.mark.parametrize("name, hidden", [
    ("t-lowbit-post", 512),  # head_dim 128: 4-bit keys by code places, two value groups sharing a tile
    ("t-lowbit-k2v4", 512),  # 2-bit keys with outliers, 4-bit uniform values
    ("t-lowbit-sinks-cg", 64),  # hidden slots: the steps that check the list are a range of their own
])
def test_the_fixed_reference_and_the_running_maximum_both_give_the_twins_output(model, registry, monkeypatch, name,
                                                                                 hidden):
    """Both softmaxes over several steps a program and several programs a row, with rows whose first steps lie before
    their first visible position (a program whose first step shows nothing has no reference: it runs again)."""
    view, rows = _post_rope_view(model, registry, name, hidden)
    dim = view.exact_k.shape[-1]
    q = torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(7))
    start = torch.tensor([100, 0][:rows], dtype=torch.int32)  # past the first steps of 16 tokens
    twin = torch_lowbit_decode(view, q, start, dim ** -0.5)
    for fixed in (True, False):
        monkeypatch.setattr(ld, "DENSE_FIXED_MAX", fixed)
        launch = plan_launch(view, q, start, dim ** -0.5, variant="dense", block=16, programs=4 * rows)
        assert launch.constants["FIX"] is fixed and launch.grid[1] >= 2
        out = lowbit_decode(view, q, start, dim ** -0.5, variant="dense", block=16, programs=4 * rows)
        assert torch.allclose(out, twin, atol=1e-5), (name, fixed, (out - twin).abs().max())


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the first pass's overflow, in the interpreter's numpy
def test_logits_that_rise_far_above_the_first_steps_run_the_program_again(model, registry):
    """Logits spread over hundreds (a query 100 times the usual): later steps rise more than 128 (base 2) above the
    first step's largest, so their exponentials against it overflow float32; the second pass against
    the largest seen gives the twin's (nearly one-hot) output. With the second pass left out the output is NaN or
    infinite (checked by mutation: ``again`` kept at 0)."""
    view, rows = _post_rope_view(model, registry, "t-lowbit-post", 512)
    dim = view.exact_k.shape[-1]
    q = 100.0 * torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(8))
    twin = torch_lowbit_decode(view, q, None, dim ** -0.5)
    programs = rows * view.exact_k.shape[1]  # one a row: all its steps in one program
    assert plan_launch(view, q, None, dim ** -0.5, variant="dense", block=16, programs=programs).grid[1] == 1
    out = lowbit_decode(view, q, None, dim ** -0.5, variant="dense", block=16, programs=programs)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, twin, atol=1e-4, rtol=1e-4), (out - twin).abs().max()
    # the logits do rise past float32's range within the program: the first 16 tokens' largest against the row's
    logits = _twin_logits(view, q, dim ** -0.5)  # [rows x heads, 4, tokens], base 2
    rise = logits.amax(-1) - logits[..., :16].amax(-1)
    assert float(rise.max()) > 128 > ld.DENSE_FIXED_LIMIT


def _twin_logits(view, q, scaling):
    """The packed tokens' logits in base 2, [B x KV heads, group, tokens], from the keys as the twin dequantizes them."""
    from kvweave.kernels.lowbit_decode import torch_keys

    rows, group = q.shape[0] * view.exact_k.shape[1], q.shape[1] // view.exact_k.shape[1]
    keys = torch_keys(view).reshape(rows, view.tokens, -1)
    queries = q.reshape(rows, group, -1).float()
    return queries @ keys.transpose(1, 2) * scaling * 1.4426950408889634
