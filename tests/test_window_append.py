"""A decode token appended to an int8 exact window by one Triton kernel (``kvweave.kernels.window``): the same codes,
scales and read-back as the window's torch path, the same range check, the same decoded tokens; and the kernel builds
for a GPU (Triton's interpreter on a CPU; tests/test_lowbit_gpu.py runs it compiled)."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.exact import ExactTokens
from kvweave.kernels import window
from kvweave.kernels.window import plan_append

from conftest import tiny_llama, write_registry
from test_lowbit_kernel_host import _nvidia_backend, compile_for_gpu


def _twins(prompt: torch.Tensor) -> tuple[ExactTokens, ExactTokens]:
    """Two int8 windows holding ``prompt``: one appending by torch operations, one by the kernel."""
    by_torch, by_kernel = ExactTokens("int8"), ExactTokens("int8")
    by_torch.fused, by_kernel.fused = False, True
    for held in (by_torch, by_kernel):
        held.append("keys", prompt)
        held.append("values", 2 * prompt)
    return by_torch, by_kernel


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 80])  # 80: a head_dim that is not a power of two (masked lanes)
def test_the_kernel_appends_and_reads_what_the_torch_path_does(dtype, dim):
    torch.manual_seed(dim)
    by_torch, by_kernel = _twins((torch.randn(2, 3, 37, dim) * 5).to(dtype))
    for step in range(5):
        new = (torch.randn(2, 3, 1, dim) * 10.0 ** step).to(dtype)  # up to 1e4: scales across float16's range
        if step == 2:
            new[0, 1, 0, 5] = float("nan")
            new[1, 2] = 0  # a zero vector: scale 0, codes 0
        if step == 3:
            new[1, 0, 0, 3] = float("inf")
        if step == 4:  # a token whose channels are not side by side in memory
            new = new.permute(3, 2, 0, 1).contiguous().permute(2, 3, 1, 0)
            assert new.reshape(6, dim).stride(-1) != 1
        for kind in ("keys", "values"):
            expected, got = by_torch.append_read(kind, new), by_kernel.append_read(kind, new)
            assert got.dtype == dtype and got.shape == (2, 3, 38 + step, dim)
            assert torch.equal(got[..., -1:, :].nan_to_num(), new.nan_to_num())  # the forward's own token as it arrived
            assert torch.equal(expected.isnan(), got.isnan()) and torch.equal(expected.nan_to_num(), got.nan_to_num())
            (codes_t, scale_t), (codes_k, scale_k) = by_torch._held[kind], by_kernel._held[kind]
            assert torch.equal(scale_t.isnan(), scale_k.isnan()) and torch.equal(scale_t.nan_to_num(), scale_k.nan_to_num())
            finite = scale_t.isfinite()  # a non-finite vector's codes are never read (its scale is NaN)
            assert torch.equal(codes_t * finite, codes_k * finite)
            assert torch.equal(by_torch[kind].nan_to_num(), by_kernel[kind].nan_to_num())  # read later: the same


@pytest.mark.interpreter
def test_the_kernel_raises_the_largest_finite_magnitude_of_every_step():
    by_torch, by_kernel = _twins(torch.ones(1, 2, 5, 64))
    magnitudes = []
    for step, peak in enumerate((3.0, 700.0, 40.0)):
        new = torch.randn(1, 2, 1, 64).clamp(-1, 1)
        new[0, step % 2, 0, 7] = -peak
        if step == 2:
            new[0, 0, 0, 0] = float("inf")  # a non-finite vector counts 0 (the flush's check names it)
            new[0, 0, 0, 1] = 1e6
        magnitudes.append(peak)
        for kind in ("keys", "values"):
            by_kernel.append_read(kind, new)
        assert float(by_kernel._worst) == max(magnitudes)


@pytest.mark.interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 2e7 / 127 in float16, as in the torch path
def test_a_decode_token_beyond_the_range_is_refused_through_the_kernel_too():
    for later in ("append", "settle"):
        _, held = _twins(torch.ones(1, 1, 3, 64))
        held.append_read("keys", torch.ones(1, 1, 1, 64))
        held.append_read("values", torch.full((1, 1, 1, 64), 2e7))  # read back as NaN until checked
        with pytest.raises(ValueError, match="largest magnitude 2e[+]07 is beyond"):
            held.append_read("keys", torch.ones(1, 1, 1, 64)) if later == "append" else held.settle()


@pytest.mark.interpreter
def test_decoding_with_the_kernel_gives_the_tokens_and_scores_of_the_torch_path(tmp_path, monkeypatch):
    registry = write_registry(tmp_path, "window-append", """
[pipelines.w-int8-lowbit]
extends = "prerope-qa35v3-lowbit"
recent_window = 16
block_tokens = 32
window_storage = "int8"

[pipelines.w-int8-lowbit.keys.quantizer]
group = 32
""")
    # head_dim 64; two layers and 32-token blocks (the append kernel runs in the interpreter: 23 decode steps reach a flush)
    model = tiny_llama(torch.bfloat16, layers=2, hidden=256)
    ids = torch.randint(1, 128, (2, 90))
    calls = []
    original = window.append_int8
    monkeypatch.setattr("kvweave.engine.exact.append_int8", lambda *a: calls.append(1) or original(*a))
    runs = {}
    for fused in (False, True):
        cache = build_cache(load_pipeline("w-int8-lowbit", registry), model)
        for layer_window in cache.engine.windows:
            layer_window.exact.fused = fused
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, min_new_tokens=24,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                 **cache_kwargs(model, cache))
        runs[fused] = (out.sequences, torch.stack(out.scores), cache.engine.windows[0].compressed_tokens, cache.memory_breakdown())
    layers = model.config.num_hidden_layers
    assert len(calls) == 2 * layers * 23  # every decode step, both kinds, every layer (24 tokens: 23 decode steps)
    assert runs[True][2] == 96  # two 32-token blocks stored by the prompt, one flushed while decoding
    assert torch.equal(runs[False][0], runs[True][0]) and torch.equal(runs[False][1], runs[True][1])
    assert runs[False][2:] == runs[True][2:]  # the same tokens held, the same stored bytes


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_append_kernel_builds_for_a_gpu(dtype):
    codes, scale = torch.zeros(4, 8, 40, 128, dtype=torch.int8), torch.ones(4, 8, 40, 1, dtype=torch.float16)
    built = compile_for_gpu(plan_append(codes, scale, torch.randn(4, 8, 1, 128).to(dtype), torch.zeros(1)))
    assert built["cubin"] > 0 and built["ptx"] > 50
    prompt = torch.randn(4, 40, 8, 128).to(dtype).transpose(1, 2)  # a prompt's values as the model gives them
    assert compile_for_gpu(window.plan_encode(prompt, torch.zeros(1)))["cubin"] > 0


def test_a_decode_token_costs_the_window_a_few_host_operations(monkeypatch):
    """A decode step is host-bound at small batches on a GPU: through the kernel, a token's append and read-back is a
    handful of host operations for both kinds (allocations and the launch), against ~50 small torch operations."""
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr("kvweave.engine.exact.append_int8", lambda *a: plan_append(*a).outputs)  # planned, not run
    counts = {}
    for fused in (False, True):
        held = ExactTokens("int8")
        for kind in ("keys", "values"):  # the prompt by torch (its kernel runs on a GPU or in the interpreter only)
            held.append(kind, torch.randn(2, 4, 30, 64))
        held.fused = fused
        new = torch.randn(2, 4, 1, 64)
        for kind in ("keys", "values"):  # the first step also makes the running maximum's buffer
            held.append_read(kind, new)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for kind in ("keys", "values"):
                held.append_read(kind, new)
        counts[fused] = [e.name for e in prof.events() if e.name.startswith("aten::")
                         and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    assert len(counts[True]) <= 10, counts[True]  # on a CPU one is the range check's read (an event on a GPU)
    assert len(counts[False]) >= 40  # the torch path's count, so the bound above says something


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [64, 80])
def test_a_prompt_is_encoded_by_one_kernel_as_the_torch_path_encodes_it(dtype, dim):
    """A prompt's tokens, given as the model gives its values (heads and tokens transposed in memory), with a NaN, an
    infinite and a zero vector: the same scales, the same codes wherever they are read, the same largest magnitude."""
    torch.manual_seed(dim)
    prompt = (torch.randn(2, 37, 3, dim) * torch.logspace(-3, 3, 37)[:, None, None]).to(dtype).transpose(1, 2)
    prompt[0, 1, 5, 3] = float("nan")
    prompt[1, 2, 36, 0] = float("-inf")
    prompt[1, 0, 9] = 0
    assert not prompt.is_contiguous()
    by_torch, by_kernel = ExactTokens("int8"), ExactTokens("int8")
    by_torch.fused, by_kernel.fused = False, True
    (codes_t, scale_t), (codes_k, scale_k) = by_torch._encode(prompt), by_kernel._encode(prompt)
    assert codes_k.dtype == torch.int8 and scale_k.dtype == torch.float16 and scale_k.shape == scale_t.shape
    assert torch.equal(scale_t.isnan(), scale_k.isnan()) and torch.equal(scale_t.nan_to_num(), scale_k.nan_to_num())
    finite = scale_t.isfinite()
    assert int((~finite).sum()) == 2 and torch.equal(codes_t * finite, codes_k * finite)
    worst = torch.zeros(1)
    window.encode_int8(prompt, worst)
    finite_values = prompt.float().nan_to_num(0.0, 0.0, 0.0).abs()
    finite_values[0, 1, 5] = 0  # the vectors holding NaN or infinity count 0
    finite_values[1, 2, 36] = 0
    assert float(worst) == float(finite_values.amax())


@pytest.mark.interpreter
def test_a_prompt_beyond_the_windows_range_is_refused_by_the_kernel_path():
    held = ExactTokens("int8")
    held.fused = True
    prompt = torch.randn(1, 2, 20, 64)
    prompt[0, 1, 4, 2] = 3e7
    with pytest.raises(ValueError, match="largest magnitude 3e[+]07 is beyond"):
        held.append("keys", prompt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares the compiled kernel with torch on a CUDA GPU")
def test_on_the_gpu_a_prompt_is_encoded_by_the_kernel_as_by_torch():
    prompt = (torch.randn(1, 4096, 8, 128, device="cuda") * 3).to(torch.bfloat16).transpose(1, 2)
    by_torch, by_kernel = ExactTokens("int8"), ExactTokens("int8")
    by_torch.fused = False  # by_kernel: None, the kernel on a GPU
    (codes_t, scale_t), (codes_k, scale_k) = by_torch._encode(prompt), by_kernel._encode(prompt)
    assert torch.equal(scale_t, scale_k) and torch.equal(codes_t, codes_k)
