"""``channel-alloc``: the bit stream of variable-width codes, the allocation, the bytes, and the pipelines
that use it (the bound of its round trip is a property test in test_lowbit_quantizer_properties.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer, allocate, pack_varwidth, unpack_varwidth
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer

from conftest import tiny_llama


def test_variable_width_codes_round_trip_and_fill_whole_bytes():
    gen = torch.Generator().manual_seed(0)
    bits = torch.tensor([[3, 5, 0, 8, 1, 7, 4, 4]] * 3).unsqueeze(1)  # 32 bits per token
    codes = torch.randint(0, 256, (3, 10, 8), generator=gen) % (1 << bits)
    packed = pack_varwidth(codes, bits, 32)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 10, 4)
    assert torch.equal(unpack_varwidth(packed, bits), codes)
    # the first code sits in the lowest bits of the first byte (little-endian stream)
    assert int(packed[0, 0, 0]) & 0b111 == int(codes[0, 0, 0])


def test_allocation_is_the_one_bit_at_a_time_greedy():
    gen = torch.Generator().manual_seed(1)
    cost = torch.rand(5, 6, generator=gen) * 10.0 ** torch.randint(-3, 3, (5, 6), generator=gen)
    for total, most in ((6, 8), (17, 8), (20, 4), (24, 4)):
        fast = allocate(cost, total, most)
        assert torch.equal(fast.sum(-1), torch.full((5,), total))
        for row in range(5):
            slow = [0] * 6
            for _ in range(total):
                gains = [cost[row, c] * 4.0 ** -slow[c] if slow[c] < most else -1 for c in range(6)]
                slow[max(range(6), key=lambda c: gains[c])] += 1
            assert fast[row].tolist() == slow


def test_wide_channels_get_more_bits_and_the_error_falls_below_uniform_bits():
    gen = torch.Generator().manual_seed(2)
    widths = torch.exp(2 * torch.randn(64, generator=gen))
    x = torch.randn(2, 4, 128, 64, generator=gen) * widths
    packed = ChannelAllocQuantizer(mean_bits=3.0, outliers=0, pairs=False).quantize(x)
    bits = packed["bits"].float().mean(dim=(0, 1, 2))
    order = widths.argsort()
    assert bits[order[-8:]].mean() > bits[order[:8]].mean() + 2
    alloc = ChannelAllocQuantizer(mean_bits=3.0, outliers=0, pairs=False)
    uniform = ChannelGroupQuantizer(bits=3, group=64, outliers=0)
    error = {q: float((q.dequantize(q.quantize(x), torch.float32) - x).norm()) for q in (alloc, uniform)}
    assert error[alloc] < 0.7 * error[uniform]


@pytest.mark.parametrize("mean_bits, outliers, pairs", list(itertools.product((2.0, 3.25, 3.5), (0, 1), (True, False))))
def test_bytes_per_vector_are_the_stored_bytes(mean_bits, outliers, pairs):
    quantizer = ChannelAllocQuantizer(mean_bits=mean_bits, outliers=outliers, pairs=pairs)
    x = torch.randn(2, 3, 128, 64)
    stored = sum(t.nbytes for t in quantizer.quantize(x).values())
    assert stored == quantizer.bytes_per_vector(64, torch.bfloat16) * 2 * 3 * 128


def test_settings_that_cannot_pack_are_refused():
    with pytest.raises(ValueError, match="mean_bits"):
        ChannelAllocQuantizer(mean_bits=3.3)
    with pytest.raises(ValueError, match="mean_bits"):
        ChannelAllocQuantizer(mean_bits=float("nan"))
    with pytest.raises(ModelError, match="whole bytes"):
        ChannelAllocQuantizer(mean_bits=3.125).check_width(8, "here")
    with pytest.raises(ModelError, match="exceeds max_bits"):
        ChannelAllocQuantizer(mean_bits=5.0, max_bits=4).check_width(64, "here")


def test_the_alloc_pipelines_store_fewer_bytes_than_4_bit_keys_and_generate():
    model = tiny_llama(torch.float32)
    ids = torch.randint(1, 100, (1, 300), generator=torch.Generator().manual_seed(3))
    ratios = {}
    for name in ("prerope-a3v2", "prerope-a35v2", "prerope-k4v2"):
        cache = build_cache(load_pipeline(name), model)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
        assert out.shape == (1, 308)
        packed = sum(v.packed_tokens for v in cache.engine.views())
        assert packed > 0
        ratios[name] = cache.memory_breakdown()["coefficients"] / packed
    assert ratios["prerope-a3v2"] < ratios["prerope-a35v2"] < ratios["prerope-k4v2"]


def test_a_head_dim_that_cannot_pack_is_refused_naming_the_slot():
    model = tiny_llama(torch.float32, hidden=40)  # head_dim 10: 3 bits x 10 channels is not whole bytes
    with pytest.raises(ModelError, match=r"slot 'keys.quantizer'.*channel-alloc"):
        build_cache(load_pipeline("prerope-a3v2"), model)
