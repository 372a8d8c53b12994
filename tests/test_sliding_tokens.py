"""The ``sliding_tokens`` setting: a sliding-window layer keeping fewer tokens than its window holds
(engine/sliding.py), kept exactly or compressed, against a toy Gemma-3 with windows of 40 tokens."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvweave.core.errors import ModelError, RegistryError
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.engine import build_cache, cache_kwargs

from conftest import GEMMA_TYPES, GEMMA_WINDOW, tiny_gemma

WINDOW = GEMMA_WINDOW
KEEP = 12
TYPES = GEMMA_TYPES
SLIDING = [layer for layer, kind in enumerate(TYPES) if kind == "sliding_attention"]

PIPELINES = f"""
[pipelines.t-keep]
extends = "full"
sliding_tokens = {KEEP}

[pipelines.t-keep-all]
extends = "full"
sliding_tokens = {WINDOW - 1}

[pipelines.t-keep-long]
extends = "full"
sliding_tokens = {WINDOW}

[pipelines.t-keep-int4]
extends = "int4"
recent_window = 8
block_tokens = 16
sliding_layers = "compress"
sliding_tokens = {KEEP}

[pipelines.t-window-int4]
extends = "t-keep-int4"
sliding_tokens = 0
"""


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma()


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    path = tmp_path_factory.mktemp("keep") / "keep.toml"
    path.write_text(PIPELINES)
    return load_registry(path)


def _generate(model, cache, ids, new=10):
    with torch.no_grad():
        return model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache))


def _prefill(model, cache, ids):
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))


def test_the_window_the_model_keeps_changes_nothing(gemma, registry):
    ids = torch.randint(1, 128, (1, 120), generator=torch.Generator().manual_seed(1))
    ours = _generate(gemma, build_cache(registry.resolve("t-keep-all"), gemma), ids)
    theirs = _generate(gemma, build_cache(load_pipeline("full"), gemma), ids)
    assert torch.equal(ours.sequences, theirs.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, theirs.scores))


def test_a_shorter_window_holds_the_last_tokens_of_the_models_own_and_counts_only_them(gemma, registry):
    ids = torch.randint(1, 128, (2, 100), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve("t-keep"), gemma)
    own = DynamicCache(config=gemma.config)
    _prefill(gemma, cache, ids)
    _prefill(gemma, own, ids)
    for layer, window in enumerate(cache.engine.windows):
        if layer in SLIDING:
            assert window.exact_tokens == KEEP and window.dropped_tokens == 100 - KEEP
            for kind, theirs in (("keys", own.layers[layer].keys), ("values", own.layers[layer].values)):
                assert torch.equal(window.exact[kind], theirs[..., -KEEP:, :])
            # the next query sees the KEEP tokens held, at their positions after the dropped ones
            assert cache.layers[layer].get_mask_sizes(1) == (KEEP + 1, 100 - KEEP)
        else:
            assert window.exact_tokens == 100
    # float32 model, batch 2, 2 KV heads of 64: the sliding part holds KEEP tokens a layer, the ratio is
    # against the model's own cache (WINDOW - 1 tokens a sliding layer)
    per_token = 2 * 2 * 2 * 64 * 4
    assert cache.memory_breakdown()["sliding_window"] == len(SLIDING) * KEEP * per_token
    assert cache.full_cache_bytes_16bit() == (len(SLIDING) * (WINDOW - 1) + 2 * 100) * per_token // 2
    assert cache.memory_bytes() == (len(SLIDING) * KEEP + 2 * 100) * per_token


def test_a_shorter_window_is_what_the_next_tokens_attend_over(gemma, registry):
    """Decoding reads the shortened windows: the logits move away from the full cache's, and stay finite."""
    ids = torch.randint(1, 128, (1, 120), generator=torch.Generator().manual_seed(3))
    ours = _generate(gemma, build_cache(registry.resolve("t-keep"), gemma), ids)
    theirs = _generate(gemma, build_cache(load_pipeline("full"), gemma), ids)
    assert torch.equal(ours.scores[0], theirs.scores[0])  # the prefill forward attends over its own tokens
    assert all(torch.isfinite(score).all() for score in ours.scores)
    assert max((a - b).abs().max().item() for a, b in zip(ours.scores[1:], theirs.scores[1:])) > 1e-3


def test_compressed_sliding_layers_drop_blocks_down_to_the_shorter_window(gemma, registry):
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(4))
    cache = build_cache(registry.resolve("t-keep-int4"), gemma)
    longer = build_cache(registry.resolve("t-window-int4"), gemma)
    _generate(gemma, cache, ids, new=20)
    _generate(gemma, longer, ids, new=20)
    total = cache.get_seq_length()
    for layer in SLIDING:
        window = cache.engine.windows[layer]
        held = window.compressed_tokens + window.exact_tokens
        assert window.dropped_tokens + held == total and window.dropped_tokens % 16 == 0
        assert KEEP <= held < KEEP + 16 + 8 + 16  # whole blocks dropped: at most a block and the window more
        assert held < longer.engine.windows[layer].compressed_tokens + longer.engine.windows[layer].exact_tokens
    assert cache.memory_bytes() < longer.memory_bytes()
    assert cache.full_cache_bytes_16bit() == longer.full_cache_bytes_16bit()


def test_a_count_past_the_window_is_refused_naming_both(gemma, registry):
    with pytest.raises(ModelError, match=rf"sliding_tokens = {WINDOW} is more than the {WINDOW - 1} tokens"):
        build_cache(registry.resolve("t-keep-long"), gemma)


def test_a_model_without_sliding_layers_refuses_the_setting(tiny_model, registry):
    with pytest.raises(ModelError, match=rf"sliding_tokens = {KEEP} shortens .* but this model has none"):
        build_cache(registry.resolve("t-keep"), tiny_model)


def test_a_negative_count_is_refused_where_the_registry_says_it(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[pipelines.t-bad]\nextends = "full"\nsliding_tokens = -3\n')
    with pytest.raises((RegistryError, ValueError), match="sliding_tokens"):
        load_registry(path).resolve("t-bad")


def test_a_left_padded_batch_keeps_the_shorter_window_per_row(gemma, registry):
    """Two rows, the second left-padded: every sliding-window layer holds KEEP tokens of each row after
    the prefill, and the unpadded row decodes as it does alone (the padded row's mask leaves it untouched)."""
    ids = torch.randint(1, 128, (2, 90), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids)
    mask[1, :25] = 0
    cache = build_cache(registry.resolve("t-keep"), gemma)
    with torch.no_grad():
        both = gemma.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(gemma, cache))
    for layer in SLIDING:
        window = cache.engine.windows[layer]
        assert window.exact_tokens == KEEP and window.exact["keys"].shape[0] == 2
    alone = _generate(gemma, build_cache(registry.resolve("t-keep"), gemma), ids[:1], new=8)
    assert torch.equal(both.sequences[0], alone.sequences[0])
    assert max((a[0] - b[0]).abs().max().item() for a, b in zip(both.scores, alone.scores)) < 1e-4
