"""A block's difference from its reconstruction and its tokens' relative misses by one Triton kernel
(``kvweave.kernels.miss``): the same values as the torch twin the encoder uses on a CPU, the same stored cache when the
encoder runs it, the refusals, the build for a GPU, and the compiled kernel at a prompt block's size."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.kernels import miss
from kvweave.kernels.miss import block_miss, block_miss_torch, misses, plan_miss

from conftest import ToyTokenizer, tiny_llama, write_registry
from test_lowbit_kernel_host import _nvidia_backend, compile_for_gpu


def _pair(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    source = (3 * torch.randn(*shape, generator=gen, device=device)).to(dtype)
    approx = source.float() + 0.3 * torch.randn(*shape, generator=gen, device=device)
    return source, approx


def _close(got, expected):
    (difference, missed), (want_difference, want_missed) = got, expected
    assert difference.dtype == torch.float32 and missed.dtype == torch.float32
    assert difference.shape == want_difference.shape and missed.shape == want_missed.shape
    torch.testing.assert_close(difference, want_difference, rtol=0, atol=0, equal_nan=True)  # one float32 subtraction
    torch.testing.assert_close(missed, want_missed, rtol=2e-6, atol=0, equal_nan=True)  # sums in another order


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 80])  # 80: channels that fill no power of two (masked lanes)
def test_the_kernel_gives_the_twins_difference_and_misses(dtype, dim):
    source, approx = _pair((2, 1, 3, 45, dim), dtype)  # 45 tokens: a last tile half full
    source[0, 0, 1, 7] = 0  # a zero vector: its miss divides by 1e-9
    approx[0, 0, 1, 7] = 0
    source[1, 0, 2, 3] = 0
    source[1, 0, 0, 9, 5] = float("nan")
    _close(block_miss(source, approx), block_miss_torch(source, approx))
    assert torch.isnan(block_miss(source, approx)[1][1, 0, 0, 9])  # NaN carried, not clamped away
    assert block_miss(source, approx)[1][1, 0, 2, 3] > 1e6  # a zero block against a reconstruction: 1e-9 below


@pytest.mark.interpreter
def test_a_block_cut_to_its_first_tokens_is_read_where_it_lies():
    """The encoder passes the block's first tokens (a router that reads only the leading ones): a view whose leading
    axes still flatten to one, read at its strides with no copy."""
    block, approx = _pair((4, 1, 2, 40, 64), torch.bfloat16, seed=1)
    source, approx = block[..., :29, :], approx[..., :29, :].contiguous()
    launch = plan_miss(source, approx)
    assert launch.args[0].data_ptr() == block.data_ptr() and launch.args[5] == 40 * 64  # the block's own stride
    _close(launch.run(), block_miss_torch(source, approx))


def test_the_kernel_refuses_what_it_cannot_read():
    source, approx = _pair((1, 2, 8, 16), torch.bfloat16)
    with pytest.raises(ValueError, match="one shape"):
        plan_miss(source, approx[..., :4, :])
    with pytest.raises(ValueError, match="float32 reconstruction"):
        plan_miss(source, approx.half())
    with pytest.raises(ValueError, match="floating block"):
        plan_miss(source.to(torch.int32), approx)


def test_off_a_gpu_the_encoder_takes_the_torch_twin(monkeypatch):
    source, approx = _pair((1, 2, 8, 16), torch.bfloat16)
    monkeypatch.setattr(miss, "block_miss", lambda *a: pytest.fail("the kernel ran for CPU tensors"))
    _close(misses(source, approx), block_miss_torch(source, approx))


@pytest.mark.interpreter
def test_the_encoder_stores_the_same_cache_with_the_kernel(tmp_path, monkeypatch):
    """depthweave-kv's router reads the misses: with a budget that gives some tokens rank 8 and others rank 4 (a token's
    miss decides which), the entries and the decode steps' scores through the kernel are those of the torch twin."""
    registry = write_registry(tmp_path, "miss", """
[pipelines.t-dw-miss]
extends = "depthweave-kv"
recent_window = 32

[pipelines.t-dw-miss.router]
target_reduction = 2.3
""")
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    ids = torch.randint(1, 128, (2, 200), generator=torch.Generator().manual_seed(3))
    runs, calls = {}, []
    for fused in (False, True):
        chosen = (lambda s, a: calls.append(1) or block_miss(s, a)) if fused else block_miss_torch
        monkeypatch.setattr("kvweave.engine.encoder.misses", chosen)
        cache = build_cache(load_pipeline("t-dw-miss", registry), model, tokenizer=ToyTokenizer())
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                 **cache_kwargs(model, cache))
        entries = [{rank: (held.entries, held.bits) for rank, held in w.residuals[kind].items()}
                   for w in cache.engine.windows for kind in ("keys", "values")]
        runs[fused] = (torch.stack(out.scores), entries, cache.memory_breakdown())
    assert calls  # the router read the misses from the kernel
    levels = runs[False][1][0]
    assert levels[4][0] and levels[8][0]  # two levels in use: the misses ranked the tokens
    for want, got in zip(runs[False][1], runs[True][1]):
        assert want.keys() == got.keys()
        for rank in want:
            assert want[rank][0] == got[rank][0] and (want[rank][1] is None or torch.equal(want[rank][1], got[rank][1]))
    assert runs[False][2] == runs[True][2]
    assert torch.equal(runs[True][0], runs[False][0])


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_kernel_builds_for_a_gpu(dtype):
    source, approx = _pair((4, 1, 8, 64, 128), dtype)
    assert compile_for_gpu(plan_miss(source, approx))["cubin"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="runs the compiled kernel on a CUDA GPU")
def test_the_compiled_kernel_at_a_prompt_blocks_size():
    """A 32K-token block of 4 layers x 8 KV heads x 128 channels, bfloat16 as the model stores it."""
    source, approx = _pair((4, 1, 8, 32768, 128), torch.bfloat16, device="cuda")
    _close(block_miss(source, approx), block_miss_torch(source, approx))
    assert misses(source, approx)[0].data_ptr() != 0 and miss.FUSED_MISS
