"""Sliding-window layers (Gemma-3 style): the cache keeps their last ``window - 1`` tokens exactly, as the
model's own cache does, compresses only the full-attention layers, and counts ratios against what the
model's own cache holds."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig

from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import model_shape
from kvweave.engine.sliding import split_sliding
from kvweave.core.errors import ModelError

from conftest import GEMMA_TYPES, GEMMA_WINDOW, ToyTokenizer, tiny_gemma

WINDOW = GEMMA_WINDOW
TYPES = GEMMA_TYPES


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


def _generate(model, cache, ids, mask=None, new=12):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache))


def test_the_shape_names_each_sliding_layer_and_its_window(gemma):
    shape = model_shape(gemma.config)
    assert shape.sliding_layers == {0: WINDOW, 1: WINDOW, 3: WINDOW, 4: WINDOW}
    assert shape.own_cache_tokens(100) == 4 * (WINDOW - 1) + 2 * 100
    assert shape.own_cache_tokens(10) == 6 * 10
    assert split_sliding([(0, 1, 2), (3, 4, 5)], shape.sliding_layers) == [(2,), (0,), (1,), (5,), (3,), (4,)]


def test_full_pipeline_matches_the_models_own_cache_and_holds_as_many_bytes(gemma):
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(1))
    cache = build_cache(load_pipeline("full"), gemma)
    ours = _generate(gemma, cache, ids)
    theirs = _generate(gemma, DynamicCache(config=gemma.config), ids)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores))
    total = cache.get_seq_length()
    for layer, window in enumerate(cache.engine.windows):
        held = WINDOW - 1 if TYPES[layer] == "sliding_attention" else total
        assert window.exact_tokens == held and window.passed_tokens == total - held
    # the model computes in float32: its own cache is twice the 16-bit one, and so is the full pipeline's
    assert cache.memory_bytes() == 2 * cache.full_cache_bytes_16bit()
    assert cache.memory_breakdown()["sliding_window"] == 4 * 2 * 2 * 64 * (WINDOW - 1) * 4


@pytest.mark.parametrize("name", ["int4", "prerope-k3v2", "kivi-2"])
def test_compressing_pipelines_compress_only_the_full_attention_layers(gemma, name):
    ids = torch.randint(1, 128, (2, 300), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :21] = 0
    cache = build_cache(load_pipeline(name), gemma, tokenizer=ToyTokenizer())
    out = _generate(gemma, cache, ids, mask, new=20)
    reference = _generate(gemma, DynamicCache(config=gemma.config), ids, mask, new=20)
    assert out.sequences.shape == reference.sequences.shape
    views = cache.engine.views()
    for layer, view in enumerate(views):
        if TYPES[layer] == "sliding_attention":
            assert view.packed_tokens == 0 and view.keys.exact.shape[-2] == WINDOW - 1
        else:
            assert view.packed_tokens > 0
    breakdown = cache.memory_breakdown()
    assert breakdown["sliding_window"] == 2 * 4 * 2 * 2 * 64 * (WINDOW - 1) * 4  # batch 2, float32
    assert cache.memory_bytes() < cache.full_cache_bytes_16bit() * 2  # below its own float32 cache

    # after a prefill, the sliding layers before the first compressed one hold what the model's own cache holds
    cache = build_cache(load_pipeline(name), gemma, tokenizer=ToyTokenizer())
    own = DynamicCache(config=gemma.config)
    with torch.no_grad():
        for target in (cache, own):
            gemma(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(gemma, target))
    for layer in (0, 1):
        assert torch.equal(cache.engine.windows[layer].exact["keys"], own.layers[layer].keys)
        assert torch.equal(cache.engine.windows[layer].exact["values"], own.layers[layer].values)


def test_a_sliding_window_without_a_size_is_refused():
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, layer_types=["sliding_attention", "full_attention"],
    )
    config.sliding_window = None
    with pytest.raises(ModelError, match="sliding_window is None"):
        model_shape(config)


COMPRESSING = """
[pipelines.t-slide-k4]
extends = "prerope-k4v2"
sliding_layers = "compress"

[pipelines.t-slide-int4]
extends = "int4"
recent_window = 16
sliding_layers = "compress"

[pipelines.t-slide-exact]
extends = "full"
compress = true
recent_window = 8
block_tokens = 16
sliding_layers = "compress"

[pipelines.t-slide-fused]
extends = "depthweave-kv"
sliding_layers = "compress"

[pipelines.t-slide-residuals]
extends = "depthweave-kv-reference-kernel"
sliding_layers = "compress"
"""


@pytest.fixture(scope="module")
def sliding_registry(tmp_path_factory):
    from kvweave.core.registry import load_registry

    path = tmp_path_factory.mktemp("sliding") / "sliding.toml"
    path.write_text(COMPRESSING)
    return load_registry(path)


def test_compressed_sliding_layers_drop_whole_blocks_outside_their_window(gemma, sliding_registry):
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    cache = build_cache(sliding_registry.resolve("t-slide-k4"), gemma)
    out = _generate(gemma, cache, ids, new=40)
    total = cache.get_seq_length()
    assert out.sequences.shape[1] == 340 and total == 339
    for layer, window in enumerate(cache.engine.windows):
        held = window.compressed_tokens + window.exact_tokens
        if TYPES[layer] == "sliding_attention":
            # every token a later query can see is held; what is dropped is whole 64-token blocks
            assert window.dropped_tokens + held == total and window.dropped_tokens % 64 == 0 and window.dropped_tokens > 0
            assert WINDOW - 1 <= held < WINDOW - 1 + 2 * 64 + 16
            assert cache.layers[layer].get_mask_sizes(1) == (held + 1, window.dropped_tokens)
        else:
            assert window.dropped_tokens == 0 and held == total
    assert "sliding_window" not in cache.memory_breakdown()  # the windows are compressed, in the other parts


def test_compressed_sliding_layers_without_quantization_give_the_models_own_outputs(gemma, sliding_registry):
    """Stored bit-exactly (the 'none' quantizer, keys after RoPE): dropping blocks and offsetting the mask
    must give what the model's own cache gives, token for token."""
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(5))
    cache = build_cache(sliding_registry.resolve("t-slide-exact"), gemma)
    ours = _generate(gemma, cache, ids, new=30)
    theirs = _generate(gemma, DynamicCache(config=gemma.config), ids, new=30)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ours.scores, theirs.scores)) < 1e-4
    assert any(w.dropped_tokens > 0 for w in cache.engine.windows)


def test_compressing_sliding_windows_lowers_the_bytes_against_the_models_own_cache(gemma, sliding_registry):
    ids = torch.randint(1, 128, (1, 400), generator=torch.Generator().manual_seed(6))
    ratios = {}
    for name, pipeline in (("exact", load_pipeline("int4")), ("compress", sliding_registry.resolve("t-slide-int4"))):
        cache = build_cache(pipeline, gemma)
        with torch.no_grad():
            gemma(input_ids=ids, use_cache=True, **cache_kwargs(gemma, cache))
        ratios[name] = cache.compression_ratio()
    assert ratios["compress"] > 1.5 * ratios["exact"]


@pytest.mark.parametrize("name, match", [("t-slide-fused", "slot 'kernel'"), ("t-slide-residuals", "residual ranks")])
def test_what_cannot_follow_dropped_blocks_is_refused(gemma, sliding_registry, name, match):
    from kvweave.core.errors import RegistryError

    with pytest.raises((RegistryError, ModelError), match=match):
        build_cache(sliding_registry.resolve(name), gemma, tokenizer=ToyTokenizer())


def test_attention_output_error_compares_sliding_layers_over_the_window_the_model_keeps(gemma, tmp_path):
    """The fidelity metric (tools/metrics.py) on a model with sliding-window layers: each is compared over the
    tokens the reference cache keeps of it (its last window), whether kvweave keeps that window exactly (no
    error in the first layer, which nothing compressed feeds) or compresses it and drops older blocks."""
    from kvweave.tools import metrics

    path = tmp_path / "fidelity.toml"
    path.write_text(
        '[pipelines.e-int8]\nextends = "int8"\nrecent_window = 8\n'
        '[pipelines.s-int8]\nextends = "e-int8"\nsliding_layers = "compress"\n'
    )
    ids = torch.randint(1, 128, (1, 330), generator=torch.Generator().manual_seed(1))  # packed tokens inside the last window
    kept = metrics.attention_output_error(gemma, None, "e-int8", ids, "cpu", registry=str(path))
    squeezed = metrics.attention_output_error(gemma, None, "s-int8", ids, "cpu", registry=str(path))
    assert kept["per_layer"][0] == 0.0 and kept["per_layer"][2] > 0  # layer 2 (full attention) is compressed
    assert 0 < squeezed["per_layer"][0] < 0.05  # int8 codes among the window's tokens
    assert all(0 <= e < 0.05 for e in squeezed["per_layer"])
