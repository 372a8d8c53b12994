"""KIVI (Liu et al. 2024) as a quantizer: 2/4-bit keys per channel over token groups, values per token.

Each property could fail: the error stays within half the stored scale on each axis, the cache holds
packed codes, and a group that does not divide the block is refused naming the pipeline and slot."""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import DynamicCache

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.plugins.quantizers.kivi import KiviKeys, KiviQuantizer, KiviValues, unpack

from conftest import tiny_llama, write_registry

REGISTRY = textwrap.dedent("""
    [pipelines.t-kivi-bad]
    extends = "kivi-2"
    block_tokens = 48
""")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return write_registry(tmp_path_factory.mktemp("kivi"), "kivi", REGISTRY)


@pytest.fixture(scope="module")
def model64():
    return tiny_llama(torch.float64)


def _prefill(model, cache, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))


def _ids(batch=1, length=100, seed=3):
    torch.manual_seed(seed)
    return torch.randint(1, 128, (batch, length))


def _outliers(shape, seed=0):
    torch.manual_seed(seed)
    x = torch.randn(shape)
    x[..., 3] *= 20  # an outlier channel, as keys have
    return x


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_keys_are_within_half_a_scale_per_channel_and_group(bits):
    x = _outliers((2, 3, 64, 64))
    quantizer = KiviKeys(bits, 32)
    packed = quantizer.quantize(x)
    assert packed["codes"].shape == (2, 3, 64, 64 * bits // 8) and packed["scale"].shape == (2, 3, 2, 64)
    x_hat = quantizer.dequantize(packed, torch.float32)
    bound = packed["scale"].float().repeat_interleave(32, dim=-2) / 2
    assert bool(((x - x_hat).abs() <= bound * (1 + 1e-6) + 1e-7).all())
    codes = unpack(packed["codes"], bits)
    assert int(codes.max()) == 2**bits - 1 and int(codes.min()) == 0  # the range is used
    # per channel: the outlier channel's scale does not coarsen the others
    assert float(packed["scale"][..., 3].float().min()) > 5 * float(packed["scale"][..., 4].float().max())


@pytest.mark.parametrize("bits", [2, 4])
def test_kivi_values_are_within_half_a_scale_per_token_group(bits):
    x = _outliers((2, 3, 40, 64), seed=1)
    quantizer = KiviValues(bits, 32)
    packed = quantizer.quantize(x)
    assert packed["scale"].shape == (2, 3, 40, 2)
    x_hat = quantizer.dequantize(packed, torch.float32)
    bound = packed["scale"].float().repeat_interleave(32, dim=-1) / 2
    assert bool(((x - x_hat).abs() <= bound * (1 + 1e-6) + 1e-7).all())
    assert float((x - x_hat).abs().max()) > 0


@pytest.mark.parametrize("name,bits", [("kivi-2", 2), ("kivi-4", 4)])
def test_kivi_cache_stores_packed_codes_within_the_bound(name, bits):
    model = tiny_llama()
    ids = _ids(length=300)
    cache = build_cache(name, model)
    reference = DynamicCache(config=model.config)
    _prefill(model, cache, ids)
    _prefill(model, reference, ids)
    for layer in range(3):
        window = cache.engine.windows[layer]
        assert window.compressed_tokens == 192 and window.exact_tokens == 108  # 96..127 recent tokens exact
        store = cache.engine.stores[layer]
        for kind, exact in (("keys", reference.layers[layer].keys), ("values", reference.layers[layer].values)):
            stored = cache.engine.reconstruct(layer, kind, torch.float32)
            fields = store[kind].coefficients.fields
            axis = -2 if kind == "keys" else -1
            group = 32 if kind == "keys" else 16  # value_group is capped at head_dim (16 here)
            bound = fields["scale"].float().repeat_interleave(group, dim=axis) / 2
            assert bool(((stored - exact[..., :192, :]).abs() <= bound * (1 + 1e-6) + 1e-6).all())
    # real bytes: codes at `bits` per value, float16 scale and zero per 32 tokens (keys) or per token (values)
    per_layer = 192 * 16 * bits // 8 * 2 + 2 * 2 * (192 // 32) * 16 + 2 * 2 * 192 * 1
    assert cache.memory_breakdown()["coefficients"] == 3 * 2 * per_layer  # batch 1, 2 KV heads


def test_kivi_quantizer_packs_keys_and_values_on_their_own_axes():
    quantizer = KiviQuantizer(bits=2, group=32, value_group=32)
    assert isinstance(quantizer.for_kind("keys"), KiviKeys) and isinstance(quantizer.for_kind("values"), KiviValues)
    assert quantizer.for_kind("keys").tokens_per_group() == 32
    with pytest.raises(ValueError, match="2 or 4"):
        KiviQuantizer(bits=3)


def test_kivi_groups_must_divide_the_block(model64, registry):
    with pytest.raises(ModelError, match=r"pipeline 't-kivi-bad', slot 'quantizer'.*groups of 32 tokens.*block_tokens \(48\)"):
        build_cache(load_pipeline("t-kivi-bad", registry), model64)


@pytest.mark.parametrize("name", ["kivi-2", "kivi-4"])
def test_each_kivi_pipeline_generates_on_a_tiny_model(name):
    model = tiny_llama()
    ids = _ids(batch=2, length=260)
    mask = torch.ones_like(ids)
    mask[0, :30] = 0
    cache = build_cache(name, model)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         **cache_kwargs(model, cache))
    assert out.shape == (2, 266)
    assert 0 < cache.memory_bytes() < cache.full_cache_bytes_16bit() * 2  # float32 model: a full cache is 2x
