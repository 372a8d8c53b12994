"""KVzip eviction (plugins/evictors/kvzip.py, engine/importance.py) end to end: a cache filled through
``kvweave.engine.importance.prefill`` and the tokens it keeps. The context importance by reconstruction and
the cuts the evictor makes from it are tested in test_kvzip_scoring.py.

Every property here could fail: the stored slots are exactly the tokens above the cut, evicted bytes leave
the cache, tokens fed after the scored forward are kept, whole quantizer groups are stored, misuse is
refused naming the fix, and perplexity with a prefill scores the tokens after it only.

The random Llama's attention is nearly uniform (its logits are about 0), so a wrong mask or a wrong
query would hardly change a score; the tests sharpen it (q_proj and k_proj scaled up) so that every
query's attention differs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvweave.core.errors import CacheStateError, ComponentError
from kvweave.core.registry import load_registry
from kvweave.engine import cache_kwargs
from kvweave.engine import importance
from kvweave.engine.slot_index import position_dtype
from kvweave.engine.generation import generate
from kvweave.engine.pipeline import build_cache
from kvweave.plugins.evictors.kvzip import KVzipEvictor
from kvweave.tools import metrics

from conftest import CharTokenizer, tiny_llama, write_registry

CONTEXT = 200  # tokens of the scored context in the end-to-end tests
SINKS = 4  # the evictor's default


TOK = CharTokenizer()

PIPELINES = """
[pipelines.t-kz]
extends = "full"
compress = true
recent_window = 16
block_tokens = 16

[pipelines.t-kz.evictor]
use = "kvzip"
fraction = 0.5

[pipelines.t-kz-layer]
extends = "t-kz"

[pipelines.t-kz-layer.evictor]
share = "layer"

[pipelines.t-kz-spread]
extends = "t-kz"

[pipelines.t-kz-spread.evictor]
spread = "segments"
segment = 32

[pipelines.t-kz-pool]
extends = "t-kz"

[pipelines.t-kz-pool.evictor]
pool = 5

[pipelines.t-kz-keep-all]
extends = "t-kz"

[pipelines.t-kz-keep-all.evictor]
fraction = 1.0

[pipelines.t-kz-none]
extends = "t-kz"

[pipelines.t-kz-none.evictor]
use = "none"

# keys per channel over groups of 16 tokens (= block_tokens); values stored as computed
[pipelines.t-kz-cg]
extends = "t-kz"

[pipelines.t-kz-cg.keys.quantizer]
use = "channel-group"
bits = 4
group = 16
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return load_registry(write_registry(tmp_path_factory.mktemp("kvzip"), "kvzip", PIPELINES))


def sharpened(seed: int = 0):
    """tiny_llama (float32, 3 layers, 2 KV heads of 4 query heads) with q_proj and k_proj scaled by 6, so
    that its attention is far from uniform."""
    model = tiny_llama(seed=seed)
    with torch.no_grad():
        for module in importance.attention_modules(model):
            module.q_proj.weight.mul_(6.0)
            module.k_proj.weight.mul_(6.0)
    return model


@pytest.fixture(scope="module")
def model():
    return sharpened()


def context_ids(batch: int = 1, length: int = CONTEXT, seed: int = 3) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randint(1, 128, (batch, length))


def make_cache(registry, name: str, model, tokenizer=TOK):
    return build_cache(registry.resolve(name), model, tokenizer=tokenizer)


def record_importance(cache) -> dict:
    """Wrap ``cache.set_importance`` so the scores ``prefill`` hands it are kept in the returned dict."""
    seen: dict = {}
    real = cache.set_importance

    def recorder(scores):
        seen["scores"] = scores.clone()
        return real(scores)

    cache.set_importance = recorder
    return seen


def kept_positions(window, head: int) -> list[int]:
    positions = window.positions[0, head]
    return positions[positions >= 0].tolist()


# ----------------------------------------------------------------------------------- end to end
def test_prefill_keeps_exactly_the_tokens_above_the_cut_and_frees_their_bytes(registry, model):
    ids = context_ids()
    full = make_cache(registry, "t-kz-none", model)
    importance.prefill(model, full, ids)
    for name in ("t-kz", "t-kz-layer"):
        cache = make_cache(registry, name, model)
        seen = record_importance(cache)
        importance.prefill(model, cache, ids)
        assert cache.get_seq_length() == CONTEXT
        scores = seen["scores"]
        assert scores.shape == (3, 1, 2, CONTEXT)
        cuts = cache.engine.evictor.cuts(scores, cache.engine.windows[0].exact_tokens)  # the window is not ranked
        assert cache.memory_bytes() < 0.75 * full.memory_bytes()
        for layer, window in enumerate(cache.engine.windows):
            passed = window.passed_tokens
            assert passed == CONTEXT - window.exact_tokens and passed > 0
            assert window.positions.dtype == torch.int16
            assert window.positions.shape[-1] == window.compressed_tokens
            for head in range(2):
                kept = kept_positions(window, head)
                assert kept == sorted(kept)
                expected = [p for p in range(passed) if scores[layer, 0, head, p] >= cuts[layer, 0, head]]
                assert kept == expected
                assert kept[:SINKS] == list(range(SINKS))
                assert 0.4 * passed <= len(kept) <= 0.65 * passed  # about half of the flushed tokens


def test_a_spread_cache_keeps_exactly_each_segments_tokens_above_its_cut(registry, model):
    cache = make_cache(registry, "t-kz-spread", model)
    seen = record_importance(cache)
    importance.prefill(model, cache, context_ids())
    scores = seen["scores"]
    cut = cache.engine.evictor.segment_cuts(scores, cache.engine.windows[0].exact_tokens)
    for layer, window in enumerate(cache.engine.windows):
        passed = window.passed_tokens
        for head in range(2):
            expected = [p for p in range(passed) if scores[layer, 0, head, p] >= cut[layer, 0, head, p]]
            assert kept_positions(window, head) == expected
            kept = torch.tensor(expected)
            for start in range(SINKS, passed - 32, 32):  # every whole segment keeps some of its tokens
                assert 0 < int(((kept >= start) & (kept < start + 32)).sum()) < 32


def test_a_pooling_cache_keeps_the_tokens_whose_pooled_scores_pass_the_cut(registry, model):
    ids = context_ids()
    cache = make_cache(registry, "t-kz-pool", model)
    seen = record_importance(cache)
    importance.prefill(model, cache, ids)
    pooled = cache.engine.evictor.prepare_importance(seen["scores"])
    cuts = cache.engine.evictor.cuts(pooled, cache.engine.windows[0].exact_tokens)
    plain = make_cache(registry, "t-kz", model)
    importance.prefill(model, plain, ids)
    differs = False
    for layer, window in enumerate(cache.engine.windows):
        for head in range(2):
            kept = kept_positions(window, head)
            assert kept == [p for p in range(window.passed_tokens) if pooled[layer, 0, head, p] >= cuts[layer, 0, head]]
            differs |= kept != kept_positions(plain.engine.windows[layer], head)
    assert differs  # pooling chose other tokens than the raw scores


def test_generation_continues_and_tokens_fed_after_the_prefill_are_kept(registry, model):
    ids = context_ids()
    cache = make_cache(registry, "t-kz", model)
    importance.prefill(model, cache, ids[:, :-1])
    before = [[kept_positions(w, h) for h in range(2)] for w in cache.engine.windows]
    new, _stats = generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache,
                           max_new_tokens=48, min_new_tokens=48, do_sample=False)
    assert new.shape == (1, 48)
    assert cache.get_seq_length() == CONTEXT + 48 - 1  # the last generated token is not fed
    for layer, window in enumerate(cache.engine.windows):
        assert window.passed_tokens > CONTEXT  # tokens after the scored forward were flushed
        assert window.positions.dtype == torch.int16
        for head in range(2):
            kept = kept_positions(window, head)
            assert kept == sorted(kept)
            assert kept[: len(before[layer][head])] == before[layer][head]  # stored slots stay
            assert [p for p in kept if p >= CONTEXT - 1] == list(range(CONTEXT - 1, window.passed_tokens))


def test_a_layers_heads_store_equal_slot_counts_without_fillers(registry, model):
    cache = make_cache(registry, "t-kz", model)
    importance.prefill(model, cache, context_ids())
    for window in cache.engine.windows:
        assert bool((window.positions >= 0).all())


def test_a_kept_fraction_of_one_changes_nothing(registry, model):
    ids = context_ids(length=120)
    cache = make_cache(registry, "t-kz-keep-all", model)
    importance.prefill(model, cache, ids)
    for window in cache.engine.windows:
        assert window.positions is None or kept_positions(window, 0) == list(range(window.passed_tokens))
    reference = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, reference))
        token = ids[:, -1:]
        ours = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits
        theirs = model(input_ids=token, use_cache=True, **cache_kwargs(model, reference)).logits
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max()


# ------------------------------------------------------------------------------------------ misuse
def test_a_forward_without_importance_is_refused_naming_prefill(registry, model):
    cache = make_cache(registry, "t-kz", model)
    with pytest.raises(Exception, match=r"kvweave\.engine\.importance\.prefill"):
        with torch.inference_mode():
            model(input_ids=context_ids(length=100), use_cache=True, **cache_kwargs(model, cache))


def test_a_cache_without_tokenizer_is_refused(registry, model):
    with pytest.raises(CacheStateError, match="tokenizer="):
        make_cache(registry, "t-kz", model, tokenizer=None)
    make_cache(registry, "t-kz-none", model, tokenizer=None)  # an evictor without importance needs none


def test_bad_importance_is_refused(registry, model):
    cache = make_cache(registry, "t-kz", model)
    good = torch.rand(3, 1, 2, 50)
    for shape in ((3, 1, 2), (2, 1, 2, 50), (3, 1, 4, 50), (3, 1, 2, 0)):
        with pytest.raises(CacheStateError, match="shaped"):
            cache.set_importance(torch.rand(shape))
    nan = good.clone()
    nan[1, 0, 1, 7] = float("nan")
    with pytest.raises(CacheStateError, match="NaN"):
        cache.set_importance(nan)
    none = make_cache(registry, "t-kz-none", model)
    with pytest.raises(CacheStateError, match="does not choose"):
        none.set_importance(good)
    filled = make_cache(registry, "t-kz", model)
    importance.prefill(model, filled, context_ids(length=50))
    with pytest.raises(CacheStateError, match="before the first forward"):
        filled.set_importance(good)


class _Shrinking(KVzipEvictor):
    def prepare_importance(self, scores):
        return scores[..., :-1]


class _Finite(KVzipEvictor):
    def prepare_importance(self, scores):
        return scores.nan_to_num(posinf=1.0)


def test_an_evictor_that_prepares_bad_importance_is_refused_naming_the_slot(registry, model):
    good = torch.rand(3, 1, 2, 50)
    good[..., :4] = math.inf
    for evictor in (_Shrinking(), _Finite()):
        cache = make_cache(registry, "t-kz", model)
        cache.engine.eviction.evictor = evictor
        with pytest.raises(ComponentError, match="slot 'evictor'.*prepare_importance"):
            cache.set_importance(good)


def test_importance_for_another_token_count_is_refused_at_the_forward(registry, model):
    for fed in (40, 60):
        cache = make_cache(registry, "t-kz", model)
        cache.set_importance(importance.reconstruction_scores(model, TOK, context_ids(length=50)))
        with pytest.raises(CacheStateError, match="scored 50 tokens"):
            with torch.inference_mode():
                model(input_ids=context_ids(length=fed), use_cache=True, **cache_kwargs(model, cache))


# ---------------------------------------------------------------------------- per-group quantizers
def test_a_group_quantizer_stores_whole_groups_of_real_tokens(registry, model):
    ids = context_ids()
    cache = make_cache(registry, "t-kz-cg", model)
    assert cache.engine.quantizer(0, "keys").tokens_per_group() == 16
    seen = record_importance(cache)
    inputs: dict = {}
    real_update = cache.engine.update

    def update(layer, keys, values):
        if layer not in inputs:
            inputs[layer] = values.clone()  # the prefill's values, as computed
        out = real_update(layer, keys, values)
        inputs[("out", layer)] = (out[0].clone(), out[1].clone())
        return out

    cache.engine.update = update
    importance.prefill(model, cache, ids[:, :-1])
    cuts = cache.engine.evictor.cuts(seen["scores"])
    for layer, window in enumerate(cache.engine.windows):
        assert bool((window.positions >= 0).all())  # topped up: no filler slot
        assert window.compressed_tokens % 16 == 0
        for head in range(2):
            kept = kept_positions(window, head)
            assert len(kept) == len(set(kept)) and kept == sorted(kept) and kept[-1] < window.passed_tokens
            chosen = [p for p in range(window.passed_tokens) if seen["scores"][layer, 0, head, p] >= cuts[layer, 0, head]]
            assert set(chosen) <= set(kept)  # the evictor's choice, topped up to the group
            assert len(kept) - len(chosen) < 16 * (1 + window.passed_tokens // 16) and len(kept) < window.passed_tokens
    new, _ = generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache,
                      max_new_tokens=20, min_new_tokens=20, do_sample=False)
    assert new.shape == (1, 20) and cache.get_seq_length() == CONTEXT + 20 - 1
    for layer, window in enumerate(cache.engine.windows):
        assert window.compressed_tokens % 16 == 0 and bool((window.positions >= 0).all())
        assert cache.engine.eviction.key_valid(layer) is None or bool(cache.engine.eviction.key_valid(layer).all())
        # the values the last decode step attended to: each stored slot holds the token its position names
        _keys, values = inputs[("out", layer)]
        slots = window.compressed_tokens
        positions = window.positions.long()[0]  # [H, slots]
        prefilled = inputs[layer][0]  # [H, T - 1, D]
        early = positions < prefilled.shape[-2]
        for head in range(2):
            picked = prefilled[head, positions[head][early[head]]]
            assert torch.allclose(values[0, head, :slots][early[head]], picked, atol=1e-6)


# ---------------------------------------------------------------------------------------- perplexity
def test_perplexity_with_a_prefill_scores_the_tokens_after_it():
    plain = tiny_llama(seed=4)
    ids = context_ids(length=90, seed=7)
    prefill = 50
    with torch.inference_mode():
        logits = plain(input_ids=ids).logits[0].float()
    nll = torch.nn.functional.cross_entropy(logits[prefill - 1 : -1], ids[0, prefill:])
    expected = math.exp(float(nll))
    got = metrics.perplexity(plain, None, ids, 16, prefill=prefill)
    assert got == pytest.approx(expected, rel=1e-5)
    everything = math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:])))
    assert metrics.perplexity(plain, None, ids, 16) == pytest.approx(everything, rel=1e-5)
    assert abs(got - everything) > 1e-3  # the prefill's own tokens are not scored
    with pytest.raises(ValueError, match="prefill"):
        metrics.perplexity(plain, None, ids, 16, prefill=90)


def test_perplexity_of_a_kvzip_cache_needs_a_prefill(registry, model):
    ids = context_ids(length=160, seed=7)
    reference = metrics.perplexity(model, None, ids, 16, prefill=120)
    same = metrics.perplexity(model, make_cache(registry, "t-kz-keep-all", model), ids, 16, prefill=120)
    assert same == pytest.approx(reference, rel=1e-4)  # everything kept: the reference's value
    cache = make_cache(registry, "t-kz", model)
    evicted = metrics.perplexity(model, cache, ids, 16, prefill=120)
    assert math.isfinite(evicted) and evicted != pytest.approx(reference, rel=1e-4)
    assert cache.engine.windows[0].compressed_tokens < cache.engine.windows[0].passed_tokens
    with pytest.raises(Exception, match=r"kvweave\.engine\.importance\.prefill"):
        metrics.perplexity(model, make_cache(registry, "t-kz", model), ids, 16)


# ------------------------------------------------------------------------------------ position dtype
def test_position_dtype_is_int16_while_every_index_fits():
    for tokens in (0, 1, 200, 32767):
        assert position_dtype(tokens) == torch.int16
    for tokens in (32768, 40000, 1 << 20):
        assert position_dtype(tokens) == torch.int32
    assert torch.iinfo(torch.int16).max >= 32767 - 1  # the largest index of a 32767-token cache fits
