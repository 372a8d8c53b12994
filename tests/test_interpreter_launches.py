"""conftest.py's skip of the interpreter's repeated language patching (tests/interpreter_launches.py): a kernel whose
loop calls device functions gives what the interpreter gives without the skip, and the language is restored after
the launch as it was before it."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.interpreter


@triton.jit
def _scaled(x, scale):
    return tl.exp(x * scale) + tl.sqrt(tl.abs(x))


@triton.jit
def _summed(x_ptr, BLOCK: tl.constexpr):
    return tl.sum(tl.load(x_ptr + tl.arange(0, BLOCK)), axis=0)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        total += _scaled(tl.load(x_ptr + row * n + offsets, mask=offsets < n, other=0.0), 0.5)
    tl.store(out_ptr + row * BLOCK + tl.arange(0, BLOCK), total + _summed(x_ptr + row * n, BLOCK))


def test_a_kernel_calling_device_functions_gives_what_the_unskipped_interpreter_gives(monkeypatch):
    from triton.runtime import interpreter

    assert os.environ.get("TRITON_INTERPRET") == "1" and getattr(interpreter._patch_lang, "once_a_launch", False)
    x = torch.randn(3, 40, generator=torch.Generator().manual_seed(0))
    before = {name: getattr(tl, name) for name in ("load", "store", "exp", "sum", "range")}
    skipped = torch.empty(3, 16)
    _kernel[(3,)](x, skipped, 40, BLOCK=16)
    assert {name: getattr(tl, name) for name in before} == before  # the language restored after the launch
    monkeypatch.setattr(interpreter, "_patch_lang", interpreter._patch_lang.real)
    plain = torch.empty(3, 16)
    _kernel[(3,)](x, plain, 40, BLOCK=16)
    assert torch.equal(skipped, plain)
    padded = torch.cat((x, torch.zeros(3, 8)), dim=1)  # the masked loads give 0: exp(0) + sqrt(0) = 1 each
    expected = sum(torch.exp(padded[:, s:s + 16] * 0.5) + padded[:, s:s + 16].abs().sqrt() for s in (0, 16, 32))
    assert torch.allclose(plain, expected + x[:, :16].sum(dim=1, keepdim=True), atol=1e-5)
