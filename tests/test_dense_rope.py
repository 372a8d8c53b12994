"""Keys stored before RoPE read by the ``lowbit`` kernel's ``dense`` variant (``ROPE``: the codes dequantized and
rotated at each slot's position in registers, :mod:`kvweave.kernels.lowbit_rope_triton`): against the torch twin
under Triton's interpreter on the pre-RoPE channel-group storages of tests/test_lowbit_kernel.py, and the launch's
choice of it."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels.lowbit_decode import dense_refusal, lowbit_decode, plan_launch, resolve_variant, torch_lowbit_decode

from test_lowbit_dense import stored_view
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


@pytest.mark.interpreter
@pytest.mark.parametrize("name, hidden", [
    ("prerope-k4v2-lowbit", 64),  # 4-bit keys with an outlier, 2-bit normal levels
    ("prerope-k4v2-lowbit", 512),  # the same at head_dim 128
    ("prerope-k4v2-lowbit", 1024),  # and at head_dim 256: eight parts of 16 pairs, four value groups
    ("t-lowbit-k2v4", 512),  # 2-bit keys with two outliers at head_dim 128, 4-bit uniform values
    ("t-lowbit-k4log8", 64),  # one-byte log8 value scales
    ("t-lowbit-kvzip-cg", 64),  # slots at their cache indices (rotated there), fillers never attended
    ("t-lowbit-sinks-cg", 64),  # slots hidden: their tokens restored and attended with the exact window
])
def test_the_dense_kernel_rotates_keys_stored_before_rope_as_the_twin_does(model, registry, name, hidden, monkeypatch):
    """At head_dim 64 the launch refuses keys before RoPE (its GPU build was off the twin): the kernel's arithmetic is
    checked there under the interpreter with the refusal lifted, and at head_dim 128 as the launch makes it, in parts
    of 16 rotary pairs and in halves."""
    from kvweave.kernels import lowbit_dense

    view, rows = stored_view(model, registry, name, hidden)
    assert view.inv_freq is not None
    if hidden == 64:
        assert "before RoPE at head_dims of at least 128" in dense_refusal(view)
        monkeypatch.setattr(lowbit_dense, "ROPE_MIN_DIM", 64)
    assert dense_refusal(view) is None, dense_refusal(view)
    dim = view.exact_k.shape[-1]
    q = torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0][:rows], dtype=torch.int32)
    twin = torch_lowbit_decode(view, q, start, dim ** -0.5)
    for pairs in (16, 32) if dim >= 128 else (16,):
        monkeypatch.setattr(lowbit_dense, "DENSE_ROPE_PAIRS", pairs)
        assert plan_launch(view, q, start, dim ** -0.5, variant="dense").constants["ROPE_PAIRS"] == pairs
        out = lowbit_decode(view, q, start, dim ** -0.5, variant="dense")
        assert torch.allclose(out, twin, atol=1e-5), (name, pairs, (out - twin).abs().max())
    # a wrong rotation, scale or outlier moves the output by its own size: the twin is not matched by chance
    assert float(twin.abs().max()) > 0.05


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernel for a CUDA GPU")
@pytest.mark.parametrize("storage", ["k4v2", "k4v2e48t", "k4v4e77t"])
def test_keys_before_rope_at_real_sizes_on_the_gpu(storage):
    """Llama-3-8B attention shape, 32,768 tokens before eviction, 2 rows, keys stored before RoPE: prerope-k4v2's
    storage (an exact outlier a token, values token by token), the 8x and ~5x classes' (slots at random positions, values
    in tiles). The dense kernel stays within the bound of the other real-size GPU tests:
    3% of the output's scale plus 6 times what rounding the query alone to bfloat16 does to the twin."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    view = packed_view(2, 32768, device="cuda", storage=storage)
    assert view.inv_freq is not None
    q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)).cuda()
    assert plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense").constants["ROPE"]
    twin = torch_lowbit_decode(view, q, None, HEAD_DIM ** -0.5)
    noise = float((torch_lowbit_decode(view, q.bfloat16().float(), None, HEAD_DIM ** -0.5) - twin).abs().max())
    bound = 0.03 * float(twin.abs().max()) + 6 * noise
    out = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense")
    assert float((out - twin).abs().max()) < bound, (storage, float((out - twin).abs().max()), bound)


def test_the_default_launch_takes_keys_before_rope_to_the_dense_kernel_once_checked_on_a_gpu(model, registry,
                                                                                              monkeypatch):
    """``ROPE_GPU_CHECKED`` decides whether "auto" gives pre-RoPE channel-group keys the dense kernel or the wide one;
    keys after RoPE take the dense kernel either way, and values in tiles over unchecked pre-RoPE keys are refused by
    "auto" with the reason."""
    import attrs

    from kvweave.kernels import lowbit_dense

    view, _ = stored_view(model, registry, "prerope-k4v2-lowbit", 512)  # head_dim 128: 64-token steps
    for checked, kernel, block in ((True, "dense", 64), (False, "wide", 32)):
        monkeypatch.setattr(lowbit_dense, "ROPE_GPU_CHECKED", checked)
        assert resolve_variant(view, "auto") == (kernel, block)
        assert resolve_variant(attrs.evolve(view, inv_freq=None), "auto") == ("dense", 64)
        assert resolve_variant(view, "dense") == ("dense", 64)  # asked for by name, it reads them unchecked too
    tiled = attrs.evolve(view, v_tiled=True)
    with pytest.raises(ValueError, match="before RoPE is not yet checked on a GPU"):
        resolve_variant(tiled, "auto")
    monkeypatch.setattr(lowbit_dense, "ROPE_GPU_CHECKED", True)
    assert resolve_variant(tiled, "auto") == ("dense", 64)


def test_the_splits_over_keys_before_rope_count_the_programs_their_registers_allow(model, registry):
    """Over keys before RoPE every program takes 128 registers a thread (4 programs of 4 warps an SM, not 5), and the
    launch's splits aim at waves of that many programs: fewer splits than over keys after RoPE where the waves decide."""
    import attrs

    from kvweave.kernels.lowbit_dense import DENSE_ROPE_REGISTERS, dense_slots, dense_splits, rope_registers

    view, _ = stored_view(model, registry, "prerope-k4v2-lowbit", 512)
    assert rope_registers(view) == DENSE_ROPE_REGISTERS == 128
    assert rope_registers(attrs.evolve(view, inv_freq=None)) is None
    assert dense_slots(132, 128, False, 4, rope_registers(view)) == 132 * 4 < dense_slots(132, 128, False, 4)
    rows, steps = 64, 1024  # 8 batch rows of 8 KV heads, 64K tokens in 64-token steps
    assert dense_splits(rows, steps, 132, 128, False, 4, rope_registers(view)) < dense_splits(rows, steps, 132, 128, False)


def test_the_rotary_pairs_a_part_follow_the_head_dim_unless_the_environment_sets_them(model, registry, monkeypatch):
    """Unset, the launch rotates halves at head_dim 128 (timed faster there) and 16 pairs at 256 (halves spill more
    there, untimed); KVWEAVE_ROPE_PAIRS (read at import into DENSE_ROPE_PAIRS) sets every head_dim, at most half of it;
    a value outside 8/16/32/64 is refused by the variable's name."""
    from kvweave.core.environment import env_setting
    from kvweave.kernels import lowbit_dense

    monkeypatch.setattr(lowbit_dense, "DENSE_ROPE_PAIRS", 0)
    assert [lowbit_dense.rope_pairs(d) for d in (64, 128, 256)] == [32, 32, 16]
    view, rows = stored_view(model, registry, "prerope-k4v2-lowbit", 512)
    q = torch.randn(rows, 4, 128)
    assert plan_launch(view, q, None, 128 ** -0.5, variant="dense").constants["ROPE_PAIRS"] == 32
    monkeypatch.setattr(lowbit_dense, "DENSE_ROPE_PAIRS", 64)
    assert [lowbit_dense.rope_pairs(d) for d in (64, 128, 256)] == [32, 64, 64]
    monkeypatch.setenv("KVWEAVE_ROPE_PAIRS", "24")
    with pytest.raises(ValueError, match="KVWEAVE_ROPE_PAIRS='24'"):
        env_setting("KVWEAVE_ROPE_PAIRS", 0, (0, 8, 16, 32, 64))
