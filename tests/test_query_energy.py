"""Key channels weighed by the queries' energy (``channel-alloc`` ``query_weight``, engine/energy.py): the
energy the cache accumulates, where the bits go, and the settings that cannot work refused."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.energy import QueryEnergy
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer

from conftest import tiny_llama

PIPELINES = """
[pipelines.qw]
extends = "prerope-a3v2"
[pipelines.qw.keys.quantizer]
query_weight = 0.5

[pipelines.qw-values]
extends = "prerope-a3v2"
[pipelines.qw-values.values.quantizer]
use = "channel-alloc"
mean_bits = 3.0
query_weight = 0.5

[pipelines.qw-eigen]
extends = "qw"
[pipelines.qw-eigen.basis]
use = "eigen-lowrank"
rank = 16
"""


def _registry(tmp_path):
    path = tmp_path / "qw.toml"
    path.write_text(PIPELINES)
    return path


def test_energy_is_the_mean_square_of_each_channel_summed_over_a_kv_heads_queries():
    energy = QueryEnergy(num_layers=2)
    gen = torch.Generator().manual_seed(0)
    first, second = torch.randn(2, 4, 5, 8, generator=gen), torch.randn(2, 4, 3, 8, generator=gen)
    energy.record(1, first, kv_heads=2)
    energy.record(1, second, kv_heads=2)
    both = torch.cat((first, second), dim=2).square().mean(dim=2)  # [B, Hq, D]
    expected = both.reshape(2, 2, 2, 8).sum(dim=2)
    assert torch.allclose(energy.means((1,))[0], expected, atol=1e-6)
    assert energy.nbytes() == 2 * 2 * 8 * 4
    energy.select_batch(torch.tensor([1, 0]))
    assert torch.allclose(energy.means((1,))[0], expected.flip(0), atol=1e-6)
    with pytest.raises(Exception, match=r"layers \[0\] have no recorded queries"):
        energy.means((0, 1))


def test_bits_follow_the_query_energy_of_equally_wide_channels():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(1, 2, 64, 16, generator=gen)  # every channel alike
    weights = torch.ones(1, 2, 16)
    weights[..., 0] = weights[..., 8] = 100.0  # the pair (0, 8): the queries look there
    quantizer = ChannelAllocQuantizer(mean_bits=3.0, outliers=0, query_weight=0.5)
    bits = quantizer.quantize(x, channel_weights=weights)["bits"]  # [1, 2, 1, 8] per pair
    assert bits.shape[-1] == 8 and bool((bits[..., 0] > bits[..., 1:].amax(dim=-1)).all())
    plain = ChannelAllocQuantizer(mean_bits=3.0, outliers=0).quantize(x)["bits"]
    assert int(plain.max() - plain.min()) <= 1  # without the weights the widths stay near-uniform
    with pytest.raises(ValueError, match="needs the queries' energy"):
        quantizer.quantize(x)


def test_the_cache_accumulates_energy_counts_it_and_generates(tmp_path):
    model = tiny_llama(torch.float32)
    ids = torch.randint(1, 100, (2, 300), generator=torch.Generator().manual_seed(3))
    cache = build_cache(load_pipeline("qw", _registry(tmp_path)), model)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    assert out.shape == (2, 304)
    means = cache.engine.energy.means(tuple(range(3)))
    assert means.shape == (3, 2, 2, 16) and bool((means > 0).all())
    assert cache.memory_breakdown()["observation"] == 3 * 2 * 2 * 16 * 4
    assert sum(v.packed_tokens for v in cache.engine.views()) > 0


def test_weighing_values_or_a_basis_that_mixes_channels_is_refused(tmp_path):
    model = tiny_llama(torch.float32)
    with pytest.raises(ModelError, match="applies to keys"):
        build_cache(load_pipeline("qw-values", _registry(tmp_path)), model)
    with pytest.raises(ModelError, match="basis 'eigen-lowrank' does not"):
        build_cache(load_pipeline("qw-eigen", _registry(tmp_path)), model)
