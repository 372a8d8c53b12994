"""KVzip's repetition scores from the Triton kernels (``kvweave.kernels.scoring``) against their torch twin, which forms the
probabilities whole: the same scores for every head dim, grouping, chunk position, sinks and tile edge, through the
whole scoring of a model too; bad shapes refused. (Triton's interpreter on a CPU; tests/test_lowbit_gpu.py runs the
kernels compiled at a real chunk's size.)"""

from __future__ import annotations

import pytest
import torch

from kvweave.engine import importance
from kvweave.kernels.scoring import repetition_key_max, repetition_key_max_torch

from test_kvzip import SINKS, TOK, context_ids
from test_kvzip import model  # noqa: F401 - the sharpened tiny model fixture


def _case(batch, heads, group, fed, context, dim, dtype, seed, sharp=3.0):
    gen = torch.Generator().manual_seed(seed)
    queries = (sharp * torch.randn(batch, heads * group, fed, dim, generator=gen)).to(dtype)
    keys = torch.randn(batch, heads, context + fed, dim, generator=gen).to(dtype)
    return queries, keys


@pytest.mark.interpreter
@pytest.mark.parametrize("batch, heads, group, fed, context, dim, start, stop, sinks, dtype", [
    (1, 2, 4, 37, 150, 64, 40, 120, 4, torch.float32),  # rows and keys past a tile's edge, sinks before the chunk
    (2, 1, 1, 70, 90, 128, 0, 90, 0, torch.float32),  # the first chunk: no sinks, the whole context
    (1, 2, 2, 20, 200, 80, 100, 117, 3, torch.bfloat16),  # a head dim that is no power of two, half operands
    (1, 1, 8, 9, 64, 64, 9, 64, 9, torch.float16),
    (1, 1, 2, 40, 80, 256, 20, 70, 4, torch.bfloat16),  # head dim 256: the narrower tiles
])
def test_the_kernels_give_the_twins_scores(batch, heads, group, fed, context, dim, start, stop, sinks, dtype):
    queries, keys = _case(batch, heads, group, fed, context, dim, dtype, seed=dim + fed)
    scaling = dim ** -0.5
    twin = repetition_key_max_torch(queries, keys, context, start, stop, sinks, scaling)
    got = repetition_key_max(queries, keys, context, start, stop, sinks, scaling)
    assert got.shape == (batch, heads, stop - start) and got.dtype == torch.float32
    assert bool((twin > 0).all()) and float(twin.std()) > 1e-3  # sharp, varied scores: a wrong mask would show
    assert torch.allclose(got, twin, rtol=2e-4, atol=1e-6), (got - twin).abs().max()


@pytest.mark.interpreter
def test_the_mask_and_the_softmax_set_matter():
    """The causal repetition and the sinks change the scores (so the equality above checks them): a kernel scoring
    with another set of keys would differ."""
    queries, keys = _case(1, 1, 4, 30, 100, 64, torch.float32, seed=1)
    base = repetition_key_max(queries, keys, 100, 40, 80, 4, 0.125)
    assert not torch.allclose(base, repetition_key_max(queries, keys, 100, 40, 80, 0, 0.125), rtol=1e-3)
    changed = keys.clone()
    changed[..., -1, :] *= 8  # the repetition's last key, which only the last fed token sees
    assert not torch.allclose(base, repetition_key_max(queries, changed, 100, 40, 80, 4, 0.125), rtol=1e-3)
    assert not torch.allclose(base, repetition_key_max(queries, keys, 100, 40, 80, 4, 0.25), rtol=1e-3)


def test_cpu_tensors_outside_the_interpreter_are_refused_by_name(monkeypatch):
    queries, keys = _case(1, 1, 2, 10, 40, 64, torch.float32, seed=3)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="only in Triton's interpreter .*backend='torch'"):
        repetition_key_max(queries, keys, 40, 0, 10, 0, 0.125)


def test_bad_shapes_and_ranges_are_refused():
    queries, keys = _case(1, 2, 2, 10, 50, 64, torch.float32, seed=2)
    for call in (repetition_key_max_torch, repetition_key_max):
        with pytest.raises(ValueError, match="expected the context's 40"):
            call(queries, keys, 40, 0, 10, 0, 0.125)
        with pytest.raises(ValueError, match="do not fit"):
            call(queries, keys, 50, 10, 60, 4, 0.125)
        with pytest.raises(ValueError, match="do not fit"):
            call(queries, keys, 50, 2, 10, 4, 0.125)  # more sinks than tokens before the chunk
        with pytest.raises(ValueError, match="do not group"):
            call(queries[:, :3], keys, 50, 0, 10, 0, 0.125)


@pytest.mark.interpreter
@pytest.mark.parametrize("chunk", [2048, 40])
def test_a_models_scores_are_the_same_by_either_backend(model, chunk):
    ids = context_ids(batch=2, length=100, seed=5)
    by_torch = importance.reconstruction_scores(model, TOK, ids, chunk=chunk, sinks=SINKS, backend="torch")
    by_kernels = importance.reconstruction_scores(model, TOK, ids, chunk=chunk, sinks=SINKS, backend="triton")
    assert torch.equal(torch.isinf(by_torch), torch.isinf(by_kernels))
    finite = torch.isfinite(by_torch)
    assert torch.allclose(by_kernels[finite], by_torch[finite], rtol=2e-4, atol=1e-6)
    with pytest.raises(Exception, match="backend must be"):
        importance.reconstruction_scores(model, TOK, ids, backend="cuda")
