"""The ``lowbit`` Triton kernels as the GPU compiles them, against their torch twin, on every storage of
tests/test_lowbit_kernel.py. CI has no GPU and runs the kernels in Triton's interpreter, which accepts code the
GPU build computes differently (the ``wide`` kernel's 16-token steps did, on an H200 with Triton 3.6): on a GPU
machine run ``python -m pytest tests/test_lowbit_gpu.py`` (``KVWEAVE_GPU_VARIANTS=dense`` for one variant's
configurations only). Skipped without CUDA."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.engine import build_cache, importance
from kvweave.kernels.lowbit_decode import (dense_refusal, lowbit_decode, plan_launch, torch_lowbit_decode, whole_byte_codes,
                                           wide_groups)

from conftest import CharTokenizer, tiny_llama
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernels for a CUDA GPU")

STORAGES = ["prerope-k4v2-lowbit", "t-lowbit-post", "t-lowbit-k2v4", "t-lowbit-v4", "t-lowbit-k3v3", "t-lowbit-alloc",
            "t-lowbit-qa35v3", "t-lowbit-alloc-post", "t-lowbit-log8", "t-lowbit-k4log8", "t-lowbit-sinks", "t-lowbit-sinks-cg",
            "t-lowbit-kvzip", "t-lowbit-kvzip-cg", "t-lowbit-sinks-kvzip"]

#: (variant, tokens a step, conversion tricks) each storage is read with, where the variant reads it
CONFIGS = [("wide", 32, ""), ("wide", 64, ""), ("general", 16, ""), ("general", 32, ""), ("auto", 16, ""), ("auto", None, ""),
           ("wide", 32, "magic"), ("wide", 32, "magic+vb16"), ("wide", 32, "ktf32"), ("general", 16, "magic"),
           ("wide", 32, "kfold+vb16"), ("dense", 64, ""), ("dense", 32, "")]
if os.environ.get("KVWEAVE_GPU_VARIANTS"):  # e.g. "dense": only those variants (a kernel change checked in a short lease)
    CONFIGS = [c for c in CONFIGS if c[0] in os.environ["KVWEAVE_GPU_VARIANTS"].split(",")]


@pytest.mark.parametrize("name", STORAGES)
def test_each_compiled_kernel_matches_its_twin_on_the_gpu(model, registry, name):  # noqa: F811 - fixtures imported
    """Over ~1,000 packed tokens (several programs a row, several steps a program), batch 2 where the pipeline
    scores whole rows one at a time otherwise 1; the GPU build takes bfloat16 tile operands, so the bound is a
    share of the output's scale (a wrong tile is off by the scale itself)."""
    big = name == "t-lowbit-k2v4"  # 2-bit keys at head_dim 128
    net = tiny_llama(layers=2, hidden=512) if big else model
    cache = build_cache(registry.resolve(name), net, tokenizer=CharTokenizer())
    rows = 1 if importance.needs_importance(cache) else 2
    ids = torch.randint(1, 128, (rows, 1100), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        importance.prefill(net, cache, ids)
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    view = attrs.evolve(view, **{f.name: getattr(view, f.name).cuda() for f in attrs.fields(type(view))
                                 if isinstance(getattr(view, f.name), torch.Tensor)})
    dim = view.exact_k.shape[-1]
    q = torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(8)).cuda()
    start = torch.tensor([300, 0][:rows], dtype=torch.int32, device="cuda")
    # keys before RoPE are also read as if stored after it (the twin alike): what the dense kernel and kfold read
    for stored, first in ((view, start), (view, None), (attrs.evolve(view, inv_freq=None), start)):
        twin = torch_lowbit_decode(stored, q, first, dim ** -0.5)
        scale = float(twin.abs().max())
        for variant, block, tricks in CONFIGS:
            if variant == "wide" and not wide_groups(stored):
                continue
            if "kfold" in tricks and (stored.inv_freq is not None or not whole_byte_codes(stored)[0]):
                continue  # keys stored after RoPE in whole-byte codes only
            if variant == "dense" and dense_refusal(stored, block) is not None:
                continue
            out = lowbit_decode(stored, q, first, dim ** -0.5, block=block, variant=variant, tricks=tricks)
            worst = float((out - twin).abs().max())
            assert worst < 0.03 * scale, (name, variant, block, tricks, worst, scale, stored.inv_freq is None)
            half = lowbit_decode(stored, q, first, dim ** -0.5, block=block, variant=variant, tricks=tricks, out_dtype=torch.bfloat16)
            assert torch.equal(half, out.to(torch.bfloat16)), (name, variant, block, tricks)  # the combine's own rounding


@pytest.mark.parametrize("storage", ["k4v2", "qa35v3"])
def test_each_compiled_kernel_matches_its_twin_at_real_sizes(storage):
    """Llama-3-8B attention shape, 32,768 packed tokens, 2 rows: the storages ``benchmarks/lowbit_kernel.py`` times
    (prerope-k4v2's, and the frontier pipelines' channel-alloc keys with 3-bit log8 values), many programs a row."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_twin_error import twin_errors

    # Over 32K random tokens the output is a mean of near-uniform weights, small against each value, and a logit
    # moved by bfloat16 rounding moves it by a share of its own size: the bound is what rounding the query alone
    # to bfloat16 does to the twin (the kernel also rounds the keys and probabilities), a wrong tile far above it.
    for row in twin_errors(storage, 32768):
        worst, scale, noise = row["worst"], row["scale"], row["noise"]
        assert noise < 0.25 * scale, (storage, noise, scale)
        assert worst < 0.03 * scale + 6 * noise, (storage, row["variant"], row["block"], worst, scale, noise)


@pytest.mark.parametrize("flat", ["k4v2e48", "k4v4e77"])
def test_values_in_tiles_give_the_token_major_output_at_real_sizes(flat):
    """The 8x frontier storage (``k4v2e48``: 4-bit keys after RoPE, 2-bit log8 values, 48% kept at their cache
    indices; ``k4v4e77``: 4-bit uniform values, 77% kept) and the same codes in tiles of 64 tokens (``...t``), 32,768
    tokens, 2 rows: the dense kernel reads both within the twin's bound, and the two launches agree to the float32
    sums' rounding (the same products; the tiled operand only comes another way into registers), or for the 4-bit
    uniform codes, read in tiles as ``1 + code / 16`` with the offset taken off once, within a tenth of that bound (the
    products' sums then run about 3 times the output's size, and so does their rounding)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    outputs = []
    for storage in (flat, flat + "t"):
        view = attrs.evolve(packed_view(2, 32768, device="cuda", storage=storage), inv_freq=None)
        assert view.v_tiled == storage.endswith("t") and dense_refusal(view) is None
        view = attrs.evolve(view, exact_k=outputs[0][1].exact_k, exact_v=outputs[0][1].exact_v) if outputs else view
        q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)).cuda()
        twin = torch_lowbit_decode(view, q, None, HEAD_DIM ** -0.5)
        noise = float((torch_lowbit_decode(view, q.bfloat16().float(), None, HEAD_DIM ** -0.5) - twin).abs().max())
        out = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="auto")
        bound = 0.03 * float(twin.abs().max()) + 6 * noise
        assert float((out - twin).abs().max()) < bound, storage
        outputs.append((out, view))
    offset_out = plan_launch(view, q.cuda(), None, HEAD_DIM ** -0.5, variant="dense").constants["LEVELS"] == 3
    assert offset_out == (flat == "k4v4e77")
    apart = float((outputs[0][0] - outputs[1][0]).abs().max())
    if offset_out:
        assert apart < 0.1 * bound, (apart, bound)
    else:
        assert torch.allclose(outputs[0][0], outputs[1][0], rtol=1e-4, atol=1e-5), apart


@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 128), (torch.float16, 128), (torch.bfloat16, 256)])
def test_the_window_append_kernel_matches_the_torch_path_on_the_gpu(dtype, dim):
    """The int8 window's append kernel (kvweave.kernels.window) compiled: codes, scales and read-back equal to the
    window's torch path at a real size (B = 8, 8 KV heads, head_dim 128 or 256, 70 held tokens), non-finite vectors
    too."""
    from kvweave.engine.exact import ExactTokens

    torch.manual_seed(0)
    windows = [ExactTokens("int8"), ExactTokens("int8")]
    windows[0].fused, windows[1].fused = False, True
    prompt = (torch.randn(8, 8, 70, dim, device="cuda") * 4).to(dtype)
    for held in windows:
        held.append("keys", prompt)
    for step in range(4):
        new = (torch.randn(8, 8, 1, dim, device="cuda") * 10.0 ** step).to(dtype)
        new[step, 3, 0, 9] = float("nan") if step % 2 else float("inf")
        expected, got = (held.append_read("keys", new) for held in windows)
        assert torch.equal(expected.nan_to_num(), got.nan_to_num()) and torch.equal(expected.isnan(), got.isnan())
        (codes_t, scale_t), (codes_k, scale_k) = windows[0]._held["keys"], windows[1]._held["keys"]
        assert torch.equal(scale_t.nan_to_num(), scale_k.nan_to_num())
        assert torch.equal(codes_t * scale_t.isfinite(), codes_k * scale_t.isfinite())


@pytest.mark.parametrize("dtype, dim", [(torch.bfloat16, 128), (torch.float16, 64), (torch.float32, 128), (torch.bfloat16, 256)])
def test_the_repetition_score_kernels_match_their_twin_on_the_gpu(dtype, dim):
    """KVzip's scores of one chunk at a real chunk's size (2,048 context tokens of an 8K context at 4,096, 2,070 fed
    tokens, 8 KV heads of 4 query heads), compiled: bfloat16/float16 operands are exact in the twin's TF32 products, so
    only the order of the sums differs; float32 keys are multiplied as float32 (``IEEE``)."""
    from kvweave.kernels.scoring import repetition_key_max, repetition_key_max_torch

    gen = torch.Generator(device="cuda").manual_seed(0)
    fed, context = 2070, 8192
    queries = (2 * torch.randn(1, 32, fed, dim, generator=gen, device="cuda")).to(dtype)
    keys = torch.randn(1, 8, context + fed, dim, generator=gen, device="cuda").to(dtype)
    twin = repetition_key_max_torch(queries, keys, context, 4096, 6144, 4, dim ** -0.5)
    got = repetition_key_max(queries, keys, context, 4096, 6144, 4, dim ** -0.5)
    assert float(twin.std()) > 1e-4
    assert torch.allclose(got, twin, rtol=1e-3, atol=1e-6), (got - twin).abs().max()
