"""``rotated-token`` ``scale_format = "log8"``: one byte per scale (``2**(-k/16)`` below a float16 maximum
per call), a layout of its own name, as accurate as float16 scales for normal levels and never short of
the range for uniform ones."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

from conftest import tiny_llama, write_registry


def _vectors(seed=0):
    torch.manual_seed(seed)
    return torch.randn(2, 3, 64, 64) * torch.logspace(-3, 1, 64)[:, None]  # per-token norms over 4 decades


def _bits(packed, x):
    return 8 * sum(t.numel() * t.element_size() for t in packed.values()) / x.numel()


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_log8_costs_one_byte_per_scale_and_loses_nothing_measurable_with_normal_levels(bits):
    x = _vectors()
    half, log8 = RotatedTokenQuantizer(bits=bits), RotatedTokenQuantizer(bits=bits, scale_format="log8")
    packed = log8.quantize(x)
    assert set(packed) == {"codes", "scale_log", "scale_max"} and packed["scale_log"].dtype == torch.uint8
    assert _bits(packed, x) == pytest.approx(bits + 8 / 64 + 16 / (64 * 64))
    assert _bits(half.quantize(x), x) == pytest.approx(bits + 16 / 64)
    assert log8.bytes_per_vector(64, torch.float16) * 8 / 64 == pytest.approx(_bits(packed, x))
    error = lambda q: float(((x - q.dequantize(q.quantize(x), torch.float32)).norm(dim=-1) / x.norm(dim=-1)).mean())  # noqa: E731
    assert error(log8) < error(half) * 1.01
    assert log8.packed_format == "rotated-token-log8.v1" and half.packed_format == "rotated-token.v1"


@pytest.mark.parametrize("symmetric", [True, False])
def test_log8_uniform_scales_still_cover_every_rotated_element(symmetric):
    x = _vectors(1)
    q = RotatedTokenQuantizer(bits=3, levels="uniform", symmetric=symmetric, scale_format="log8")
    packed = q.quantize(x)
    scale = packed["scale_max"].float() * torch.exp2(-packed["scale_log"].float() / 16)  # [..., n, 1]
    matrix = q.rotation_for(64, x.device)
    rotated, restored = x @ matrix.T, q.dequantize(packed, torch.float32) @ matrix.T
    assert bool(((rotated - restored).abs() <= scale * 0.5 * (1 + 1e-4) + 1e-6).all())


def test_a_log8_pipeline_stores_fewer_bytes_and_the_lowbit_kernel_resolves_it(tmp_path):
    path = write_registry(tmp_path, "log8", """
[pipelines.v-half]
extends = "prerope-qa3v2"
recent_window = 16

[pipelines.v-log8]
extends = "v-half"
[pipelines.v-log8.values.quantizer]
scale_format = "log8"

[pipelines.v-log8-lowbit]
extends = "v-log8"
[pipelines.v-log8-lowbit.kernel]
use = "lowbit"
""")
    assert load_registry(path).resolve("v-log8-lowbit").use("kernel") == "lowbit"  # read in place (tests/test_lowbit_kernel.py)
    model = tiny_llama(torch.float32, hidden=256)  # head_dim 64
    ids = torch.randint(1, 128, (1, 144))  # the prefill flushes 128 tokens at once, the next 64 one by one:
    parts = {}
    for name in ("v-half", "v-log8"):
        cache = build_cache(load_pipeline(name, path), model)
        with torch.no_grad():
            out = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            for _ in range(64):  # flushes of one block each, appended to the prefill's (one maximum per 64 tokens throughout)
                out = model(input_ids=out.logits[:, -1:].argmax(-1), use_cache=True, **cache_kwargs(model, cache))
        parts[name] = cache.memory_breakdown()["coefficients"]
    vectors = 3 * 2 * 192  # layers x KV heads x packed tokens
    # a byte saved per vector, less one float16 maximum per 64 tokens, layer and head
    assert parts["v-half"] - parts["v-log8"] == vectors * 1 - 3 * 2 * 3 * 2


def test_log8_needs_whole_spans_of_tokens_and_the_cache_checks_its_blocks(tmp_path):
    q = RotatedTokenQuantizer(scale_format="log8", scale_tokens=64)
    with pytest.raises(ModelError, match="every 64 tokens .* got 40 tokens"):
        q.quantize(torch.randn(1, 40, 64))
    assert q.tokens_per_group() == 64 and RotatedTokenQuantizer().tokens_per_group() == 1
    path = write_registry(tmp_path, "log8", """
[pipelines.v-short-blocks]
extends = "prerope-qa3v2"
block_tokens = 32
[pipelines.v-short-blocks.keys.quantizer]
group = 32
[pipelines.v-short-blocks.values.quantizer]
scale_format = "log8"
""")
    with pytest.raises(ModelError, match=r"slot 'values.quantizer' \('rotated-token'\): it packs groups of 64 tokens"):
        build_cache(load_pipeline("v-short-blocks", path), tiny_llama(torch.float32, hidden=256))
