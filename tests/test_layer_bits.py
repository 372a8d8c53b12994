"""Per-layer widths (``layer_bits``): each layer is encoded and decoded with its own width, the bytes follow
the table, and tables that do not fit the model or the basis are refused naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

from conftest import tiny_llama

TABLES = """
[pipelines.lb]
extends = "prerope-a3v2"
[pipelines.lb.keys.quantizer]
layer_bits = [2.0, 4.0, 3.0]
[pipelines.lb.values.quantizer]
layer_bits = [4, 2, 3]

[pipelines.lb-short]
extends = "prerope-a3v2"
[pipelines.lb-short.values.quantizer]
layer_bits = [3, 2]

[pipelines.lb-depth]
extends = "depthweave-kv-reference-kernel"
[pipelines.lb-depth.quantizer]
use = "rotated-token"
rotation = "random"
layer_bits = [2, 3, 3]
"""


def _registry(tmp_path):
    path = tmp_path / "tables.toml"
    path.write_text(TABLES)
    return path


def test_for_layer_takes_the_layers_width_and_drops_the_table():
    keys = ChannelAllocQuantizer(layer_bits=[3.0, 3.5])
    assert keys.for_layer(1) == ChannelAllocQuantizer(mean_bits=3.5)
    assert ChannelAllocQuantizer(mean_bits=3.0).for_layer(7) == ChannelAllocQuantizer(mean_bits=3.0)
    assert RotatedTokenQuantizer(layer_bits=(4, 2)).for_layer(0).bits == 4


def test_bad_entries_are_refused_naming_the_layer():
    with pytest.raises(ValueError, match=r"entry 1 \(layer 1\).*2, 3 or 4"):
        RotatedTokenQuantizer(layer_bits=[2, 5])
    with pytest.raises(ValueError, match=r"entry 0 \(layer 0\).*1/8"):
        ChannelAllocQuantizer(layer_bits=[3.1, 3.0])
    with pytest.raises(TypeError, match="list of numbers"):
        RotatedTokenQuantizer(layer_bits="3")


def test_each_layer_stores_its_own_width_and_the_model_generates(tmp_path):
    model = tiny_llama(torch.float32)  # 3 layers, 2 KV heads, head_dim 16
    ids = torch.randint(1, 100, (1, 300), generator=torch.Generator().manual_seed(5))
    cache = build_cache(load_pipeline("lb", _registry(tmp_path)), model)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    assert out.shape == (1, 306)
    views = cache.engine.views()
    packed = views[0].packed_tokens
    assert packed > 0 and all(v.packed_tokens == packed for v in views)
    heads, width = 2, 16
    for layer, (key_bits, value_bits) in enumerate(zip((2.0, 4.0, 3.0), (4, 2, 3))):
        keys, values = views[layer].keys, views[layer].values
        assert keys.quantizer.mean_bits == key_bits and values.quantizer.bits == value_bits
        # the packed codes are as wide as the layer's entry says
        assert keys.coefficients["codes"].shape[-1] == key_bits * width / 8
        value_bytes = sum(t.nbytes for t in values.coefficients.values())
        assert value_bytes == values.quantizer.bytes_per_vector(width, torch.float32) * heads * packed
    # what attention reads is decoded with each layer's own width: the value error follows the bits
    exact = build_cache(load_pipeline("full"), model)
    with torch.inference_mode():
        model(input_ids=out[:, :-1], use_cache=True, **cache_kwargs(model, exact))
    error = []
    for layer in range(3):
        got = cache.engine.materialize(layer, "values")[..., :packed, :]
        want = exact.engine.materialize(layer, "values")[..., :packed, :]
        error.append(float((got - want).norm() / want.norm()))
    assert error[0] < error[2] < error[1] < 0.5  # 4, 3 and 2 bits


def test_a_table_of_the_wrong_length_is_refused_with_both_counts(tmp_path):
    with pytest.raises(ModelError, match="layer_bits has 2 entries but the model has 3 layers"):
        build_cache(load_pipeline("lb-short", _registry(tmp_path)), tiny_llama(torch.float32))


def test_layers_encoded_together_must_share_a_width(tmp_path):
    with pytest.raises(ModelError, match=r"layers \[0, 1(, 2)?\] are encoded together"):
        build_cache(load_pipeline("lb-depth", _registry(tmp_path)), tiny_llama(torch.float32))
