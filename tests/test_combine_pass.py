"""The fused decode kernel's combine passes: the one-pass combine (a slice of the columns a program, every slot in one
step with a running maximum) against the merge written out in torch and against the two-pass combine, on partials
made up here (empty slots, rows with nothing attended) and on depthweave-kv's storage written by the real engine.

Runs under ``TRITON_INTERPRET=1`` on a machine without CUDA (conftest.py), the compiled kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import kvweave.kernels.depthweave_decode as depthweave_decode
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.depthweave_decode import fused_decode

from test_kernels import DEVICE, decode_view, filled

EMPTY = -1.0e30  # what a pass stores as the maximum of a slot that attended nothing


def _merged(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Slots [rows, P] (base-2 maxima, sums) and outputs [rows, P, D] merged: sum_j 2^(m_j - M) acc_j / sum_j 2^(m_j - M) l_j,
    zeros where no slot holds a sum."""
    top = m.amax(-1, keepdim=True)
    weight = torch.exp2(m - top)
    total = (weight * l).sum(-1, keepdim=True)
    out = (weight[..., None] * acc).sum(-2) / torch.where(total > 0, total, 1.0)
    return torch.where(total > 0, out, 0.0)


def _partials(rows: int, slots: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    m = torch.randn(rows, slots, generator=gen) * 6
    l = torch.rand(rows, slots, generator=gen) * 5 + 0.1
    acc = torch.randn(rows, slots, dim, generator=gen) * l[..., None]
    empty = torch.rand(rows, slots, generator=gen) < 0.3
    empty[1] = True  # a row that attended nothing (all of it left padding)
    m[empty], l[empty], acc[empty] = EMPTY, 0.0, 0.0
    return m, l, acc


@pytest.mark.parametrize("dim,slots,elements", [(128, 37, 4096), (128, 150, 4096), (64, 300, 512), (256, 9, 4096), (64, 1, 4096)],
                         ids=["one-step", "two-steps", "many-steps", "d256", "window-only"])
def test_the_one_pass_combine_merges_the_slots_as_written_out(dim, slots, elements):
    from kvweave.kernels import decode_triton as jit

    rows = 6
    m, l, acc = _partials(rows, slots, dim, seed=slots)
    expected = _merged(m, l, acc)
    assert bool((expected[1] == 0).all()) and bool((expected.abs() > 0).any())
    args = [t.to(DEVICE).contiguous() for t in (m.flatten(), l.flatten(), acc.reshape(-1, dim))]
    out = torch.empty(rows, dim, device=DEVICE)
    slices = depthweave_decode.COMBINE_SLICES
    chunk = min(depthweave_decode._pow2(slots, 4), max(4, elements * slices // dim))
    jit._combine_columns_kernel[(rows, slices)](*args, out, slots, D=dim, DC=dim // slices, CHUNK=chunk)
    assert (chunk < slots) == (slots > 37), "several steps where the slots exceed one"
    assert torch.allclose(out.cpu(), expected, atol=1e-5, rtol=1e-5), (out.cpu() - expected).abs().max()
    two_pass = torch.empty(rows, dim, device=DEVICE)
    jit._combine_kernel[(rows,)](*args, two_pass, slots, D=dim, CHUNK=16)
    assert torch.allclose(out, two_pass, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_heads,kv_heads,head_dim,tokens", [(8, 2, 128, 192), (3, 1, 64, 192)],
                         ids=["gqa4-d128", "gqa3-d64"])
def test_fused_decode_with_the_one_pass_combine_is_the_two_pass_ones(tmp_path, monkeypatch, q_heads, kv_heads, head_dim, tokens):
    cache = filled(tmp_path, q_heads, kv_heads, head_dim, tokens)
    view = decode_view(cache, 1)
    torch.manual_seed(0)
    query = torch.randn(2, q_heads, head_dim, device=DEVICE)
    start = torch.tensor([0, 45], dtype=torch.int32, device=DEVICE)
    scale = head_dim**-0.5
    twin = torch_decode(view, query, start, scale)
    two_pass = fused_decode(view, query, start, scale, split=32, combine="two-pass")
    one_pass = fused_decode(view, query, start, scale, split=32, combine="one-pass")
    monkeypatch.setattr(depthweave_decode, "COMBINE_ELEMENTS", 4 * head_dim // depthweave_decode.COMBINE_SLICES)
    stepped = fused_decode(view, query, start, scale, split=32, combine="one-pass")  # 4 slots a step: several steps
    assert view.packed_tokens // 32 + 1 > 4
    for out in (one_pass, stepped):
        assert torch.allclose(out, two_pass, atol=1e-5, rtol=1e-5), (out - two_pass).abs().max()
    assert (one_pass - twin).abs().max().item() < 1e-3
    assert torch.equal(fused_decode(view, query, start, scale, split=32), stepped)  # the default: one-pass
    monkeypatch.setattr(depthweave_decode, "COMBINE", "two-pass")  # the default taken from the module
    assert torch.equal(fused_decode(view, query, start, scale, split=32), two_pass)


def test_an_unknown_combine_is_refused_by_name(tmp_path):
    cache = filled(tmp_path, 4, 2, 64, 192, batch=1)
    view = decode_view(cache, 0)
    with pytest.raises(ValueError, match="combine 'three-pass' is not one of two-pass, one-pass"):
        fused_decode(view, torch.randn(1, 4, 64, device=DEVICE), None, 0.125, combine="three-pass")
