"""KVzip's context importance by reconstruction (engine/importance.py) and the cuts its evictor makes
from it (plugins/evictors/kvzip.py).

Every property here could fail: the scores equal a brute-force recomputation of the repetition's
attention (its queries from the layer's own q_proj and rotary, a softmax over the sinks, the chunk and the
causal repetition), chunks are scored separately and a row's scores do not depend on the other rows; the
cuts keep the counts the evictor's docstring promises (per head of a layer, over the model, per segment,
after pooling), and bad settings are refused.

The random Llama's attention is nearly uniform (its logits are about 0), so a wrong mask or a wrong
query would hardly change a score; the scoring tests use test_kvzip.py's sharpened model (q_proj and
k_proj scaled up) so that every query's attention differs."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DynamicCache

from kvweave.engine import cache_kwargs
from kvweave.engine import importance
from kvweave.plugins.evictors.kvzip import KVzipEvictor

from test_kvzip import SINKS, TOK, context_ids
from test_kvzip import model, registry  # noqa: F401 - the sharpened tiny model fixture, the t-kz pipelines


# ------------------------------------------------------------------------------ reconstruction scores
def encode(text: str, batch: int) -> torch.Tensor:
    return TOK(text)["input_ids"].expand(batch, -1)


def brute_force_scores(model, ids: torch.Tensor, layer: int, chunk: int, sinks: int) -> torch.Tensor:
    """[B, H, T] the scores of ``layer`` recomputed from scratch: the context prefilled into a fresh
    DynamicCache for every chunk, the repeat input fed after it, the layer's queries recomputed from its
    input (captured by a pre-hook), attention over every key with a mask allowing the first ``sinks``
    tokens before the chunk, the chunk and the repetition causally; the largest probability over queries
    and the query heads of each KV head. Each row quotes its own previous tokens after a later chunk's
    prompt. float64."""
    batch, total = ids.shape
    module = importance.attention_modules(model)[layer]
    heads = model.config.num_key_value_heads
    out = torch.full((batch, heads, total), float("nan"), dtype=torch.float64)
    for start in range(0, total, chunk):
        stop = min(total, start + chunk)
        if start == 0:
            ask = encode(importance.REPEAT_PROMPT, batch)
        else:
            ask = torch.cat((encode(importance.REPEAT_CONTINUE, batch), ids[:, max(0, start - importance.OVERLAP_TOKENS) : start]), -1)
        fed = torch.cat((ask, encode("\n", batch), ids[:, start:stop]), -1)
        seen: dict = {}

        def capture(_module, args, kwargs):
            seen["hidden"] = args[0] if args else kwargs["hidden_states"]
            seen["rotary"] = kwargs["position_embeddings"]

        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
            handle = module.register_forward_pre_hook(capture, with_kwargs=True)
            try:
                model(input_ids=fed, use_cache=True, **cache_kwargs(model, cache))
            finally:
                handle.remove()
            queries = importance.module_queries(module, seen["hidden"], seen["rotary"]).double()  # [B, Hq, n, D]
            keys = cache.layers[layer].keys.double()  # [B, H, T + n, D]
        n = fed.shape[-1]
        group = queries.shape[1] // heads
        assert keys.shape[-2] == total + n
        logits = queries @ keys.repeat_interleave(group, dim=1).transpose(-1, -2) * module.scaling
        allowed = torch.zeros(n, total + n, dtype=torch.bool)
        allowed[:, : min(sinks, start)] = True
        allowed[:, start:stop] = True
        allowed[:, total:] = torch.ones(n, n, dtype=torch.bool).tril()
        probs = logits.masked_fill(~allowed, float("-inf")).softmax(-1)[..., start:stop]
        out[..., start:stop] = probs.reshape(batch, heads, group, n, stop - start).amax(dim=(2, 3))
    return out


def test_scores_shape_dtype_sinks_and_range(model):
    ids = context_ids(batch=2, length=60)
    scores = importance.reconstruction_scores(model, TOK, ids, sinks=SINKS)
    assert scores.shape == (3, 2, 2, 60) and scores.dtype == torch.float32
    assert bool(torch.isposinf(scores[..., :SINKS]).all())
    rest = scores[..., SINKS:]
    assert bool(torch.isfinite(rest).all())
    assert bool((rest > 0).all()) and bool((rest <= 1).all())
    assert float(rest.std()) > 1e-3  # the sharpened model's scores differ between tokens


@pytest.mark.parametrize("chunk", [2048, 40])
def test_scores_equal_a_brute_force_recomputation(model, chunk):
    ids = context_ids(length=100, seed=5)
    scores = importance.reconstruction_scores(model, TOK, ids, chunk=chunk, sinks=SINKS)
    assert bool(torch.isposinf(scores[..., :SINKS]).all())
    assert bool(torch.isfinite(scores[..., SINKS:]).all())  # every chunk scored every one of its tokens
    for layer in range(3):
        expected = brute_force_scores(model, ids, layer, chunk, SINKS)
        got = scores[layer, ..., SINKS:].double()
        assert torch.allclose(got, expected[..., SINKS:], atol=1e-5, rtol=0), (got - expected[..., SINKS:]).abs().max()


def test_chunks_are_scored_separately_and_sinks_count_in_every_softmax(model):
    ids = context_ids(length=100, seed=5)
    whole = importance.reconstruction_scores(model, TOK, ids, chunk=2048, sinks=SINKS)
    chunked = importance.reconstruction_scores(model, TOK, ids, chunk=40, sinks=SINKS)
    # the first chunk is fed with the same prompt but softmaxes over 40 context tokens, not 100
    assert not torch.allclose(whole[..., SINKS:40], chunked[..., SINKS:40], atol=1e-4)
    no_sinks = importance.reconstruction_scores(model, TOK, ids, chunk=40, sinks=0)
    assert bool(torch.isfinite(no_sinks).all())
    # within the first chunk the sinks are chunk tokens anyway; later chunks lose them from the softmax
    assert torch.allclose(no_sinks[..., SINKS:40], chunked[..., SINKS:40], atol=1e-6)
    assert bool((no_sinks[..., 40:] >= chunked[..., 40:] - 1e-7).all())
    assert not torch.allclose(no_sinks[..., 40:], chunked[..., 40:], atol=1e-4)


def test_a_rows_scores_do_not_depend_on_the_other_rows(model):
    ids = context_ids(batch=2, length=100, seed=5)
    batch = importance.reconstruction_scores(model, TOK, ids, chunk=40, sinks=SINKS)
    alone = importance.reconstruction_scores(model, TOK, ids[1:], chunk=40, sinks=SINKS)
    assert torch.allclose(batch[:, 1:, :, SINKS:], alone[..., SINKS:], atol=1e-5)


def test_turn_suffix_is_a_newline_without_a_chat_template():
    assert importance.turn_suffix(TOK) == "\n"


# ------------------------------------------------------------------------------------------ cuts
def kept_counts(scores: torch.Tensor, cuts: torch.Tensor) -> torch.Tensor:
    """[L, B, H] tokens of finite score at or above the cut."""
    return (torch.isfinite(scores) & (scores >= cuts[..., None])).sum(-1)


def test_layer_share_keeps_the_fraction_of_each_heads_scored_tokens():
    torch.manual_seed(0)
    scores = torch.rand(3, 2, 2, 50)
    scores[..., :SINKS] = float("inf")
    for fraction in (0.3, 0.5, 0.77, 1.0):
        cuts = KVzipEvictor(fraction=fraction, share="layer").cuts(scores)
        assert cuts.shape == (3, 2, 2)
        expected = math.ceil(fraction * (50 - SINKS))
        assert kept_counts(scores, cuts).tolist() == [[[expected] * 2] * 2] * 3
        assert bool((scores[..., :SINKS] >= cuts[..., None]).all())  # +inf always kept


def test_model_share_keeps_the_fraction_overall_and_more_in_layers_read_more():
    torch.manual_seed(1)
    scores = torch.rand(4, 1, 2, 64) * torch.tensor([1.0, 2.0, 4.0, 8.0])[:, None, None, None]
    scores[..., :SINKS] = float("inf")
    finite = int(torch.isfinite(scores).sum())
    cuts = KVzipEvictor(fraction=0.4, share="model").cuts(scores)
    counts = kept_counts(scores, cuts)[:, 0]  # [L, H]
    assert int(counts.sum()) >= 0.4 * finite
    assert int(counts.sum()) <= 0.4 * finite + 4 * 2  # at most one more per layer and head (rounding up)
    assert bool((counts[:, 0] == counts[:, 1]).all())  # a layer's heads keep the same count
    per_layer = counts[:, 0].tolist()
    assert per_layer == sorted(per_layer) and per_layer[0] < per_layer[-1]
    assert bool((scores[..., :SINKS] >= cuts[..., None]).all())


def test_cuts_are_each_heads_kth_largest_score_with_k_its_layers_kept_count():
    """The cuts of every layer, row and head at once equal a top-k of each head's scored tokens, k being its layer's
    kept count (+inf where it keeps none, -inf where nothing is scored), taken one head at a time."""
    torch.manual_seed(3)
    scores = torch.rand(5, 2, 3, 40)
    scores[..., :SINKS] = float("inf")
    scores[2] = float("inf")  # nothing scored
    scores[3, 1, :, SINKS:] = torch.linspace(0, 1, 36)  # ties across heads
    for share, fraction, window in (("model", 0.3, 0), ("layer", 0.5, 8), ("model", 0.01, 30)):
        evictor = KVzipEvictor(fraction=fraction, share=share)
        finite, counts, kept = evictor._scored(scores, window)
        ranked = scores.masked_fill(~finite, -math.inf)
        expect = torch.full(scores.shape[:3], -math.inf)
        for layer in range(5):
            for row in range(2):
                n, k = int(counts[layer, row]), int(kept[layer, row])
                if n:
                    expect[layer, row] = ranked[layer, row].topk(k, dim=-1).values[:, -1] if k else math.inf
        assert torch.equal(evictor.cuts(scores, window), expect)
        assert torch.equal(evictor.cuts(scores, window, [4, 0]), expect[[4, 0]])


def test_a_forward_ranks_the_models_scores_once_for_all_its_layers(model, registry, monkeypatch):  # noqa: F811
    """Each layer's flush takes its cut from one ranking of the whole model's scores (the threshold is the model's),
    made at the first flush: not one ranking a layer."""
    from kvweave.engine.pipeline import build_cache

    ranked: list[int] = []
    original = KVzipEvictor._scored
    monkeypatch.setattr(KVzipEvictor, "_scored", lambda self, *a, **k: ranked.append(1) or original(self, *a, **k))
    cache = build_cache(registry.resolve("t-kz"), model, tokenizer=TOK)
    with torch.no_grad():
        importance.prefill(model, cache, context_ids(length=120, seed=9))
    layers = len(cache.engine.windows)
    assert layers > 1 and len(ranked) == 1
    assert all(0 < w.compressed_tokens < w.passed_tokens for w in cache.engine.windows)  # every layer evicted


def test_a_layer_with_only_infinite_scores_keeps_everything():
    torch.manual_seed(2)
    scores = torch.rand(3, 1, 2, 30)
    scores[1] = float("inf")  # e.g. a sliding-window layer the scorer cannot see whole
    for share in ("model", "layer"):
        cuts = KVzipEvictor(fraction=0.5, share=share).cuts(scores)
        assert bool(torch.isneginf(cuts[1]).all())
        assert bool(torch.isfinite(cuts[0]).all()) and bool(torch.isfinite(cuts[2]).all())
        kept = int(kept_counts(scores, cuts)[[0, 2]].sum())
        assert 60 <= kept <= 64  # the scored layers keep half of their 2 x 2 x 30 tokens (rounded up per head)


def test_segments_keep_each_part_of_the_context_its_layers_share():
    """spread = "segments": scores that rise with position (as reconstruction scores do) keep the layer's share
    of every 16-position segment instead of the last positions only; the total per head is what cuts keeps."""
    torch.manual_seed(4)
    total, size = 96, 16
    scores = torch.rand(2, 1, 2, total) + torch.linspace(0, 4, total)  # later tokens score higher
    scores[..., :SINKS] = float("inf")
    for share in ("model", "layer"):
        plain = KVzipEvictor(fraction=0.5, share=share)
        spread = KVzipEvictor(fraction=0.5, share=share, spread="segments", segment=size)
        whole = kept_counts(scores, plain.cuts(scores))  # [L, B, H]
        cut = spread.segment_cuts(scores)  # [L, B, H, T]
        kept = torch.isfinite(scores) & (scores >= cut)
        first = int(kept[..., SINKS:size].sum()), int(kept[..., -size:].sum())
        assert first[0] >= 0.4 * 2 * 2 * (size - SINKS) and first[1] <= 0.6 * 2 * 2 * size  # the share, in both ends
        plain_kept = torch.isfinite(scores) & (scores >= plain.cuts(scores)[..., None])
        assert int(plain_kept[..., SINKS:size].sum()) == 0  # without spreading, the first segment keeps nothing
        assert abs(int(kept.sum()) - int(whole.sum())) <= 2 * 2 * (total // size)  # rounding up per segment at most
    with pytest.raises(ValueError):
        KVzipEvictor(spread="even")


def test_pooling_takes_each_tokens_largest_neighbour_and_leaves_infinite_scores_alone():
    torch.manual_seed(0)
    scores = torch.rand(2, 1, 3, 40)
    scores[..., :4] = math.inf  # sinks
    scores[1] = math.inf  # a layer the scorer cannot see whole
    pooled = KVzipEvictor(pool=5).prepare_importance(scores)
    assert torch.equal(KVzipEvictor().prepare_importance(scores), scores)  # pool = 1: as scored
    assert torch.isinf(pooled[1]).all() and torch.isinf(pooled[..., :4]).all()
    for t in range(4, 40):  # a window of +-2 positions, the sinks lending nothing
        lo, hi = max(4, t - 2), min(40, t + 3)
        assert torch.equal(pooled[0, 0, :, t], scores[0, 0, :, lo:hi].amax(-1))
    assert bool((pooled[0] >= scores[0]).all()) and not torch.equal(pooled[0], scores[0])


def test_the_first_sinks_positions_are_kept_whatever_scored_them():
    """Scores from elsewhere than KVzip's scorer (the synthetic fill's random ones, a user's own) keep the evictor's
    sinks too: without it a benchmark filled at random evicted positions 0-3 in half the heads, which real scoring never
    does (and the sinks router then restored other tokens than the sinks)."""
    scores = torch.rand(2, 1, 3, 40, generator=torch.Generator().manual_seed(3))
    for sinks in (0, 1, 4):
        prepared = KVzipEvictor(sinks=sinks).prepare_importance(scores)
        assert torch.isinf(prepared[..., :sinks]).all() and torch.equal(prepared[..., sinks:], scores[..., sinks:])
    assert torch.isfinite(scores).all()  # the caller's tensor is left as it was
    kept = KVzipEvictor(fraction=0.1).prepare_importance(scores)
    assert torch.isinf(kept[..., :4]).all() and bool((kept[..., 4:] < 1).all())


def test_fraction_and_share_are_validated():
    for bad in (0.0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="fraction"):
            KVzipEvictor(fraction=bad)
    with pytest.raises(ValueError):
        KVzipEvictor(share="head")
    for bad in (0, 4, 257):
        with pytest.raises(ValueError, match="pool"):
            KVzipEvictor(pool=bad)


def test_repetitions_are_written_after_the_context_in_place_and_sliding_layers_still_score_inf(monkeypatch):
    """The scoring cache's full-attention layers keep the context where the prefill wrote it (each repetition written
    after it, the buffer never reallocated); a model with sliding-window layers (toy Gemma 3) gets scores in its
    full-attention layers, equal to those of concatenating each repetition to a copy of the context, and +inf in its
    sliding ones. A repetition longer than the room made for it is refused."""
    from conftest import GEMMA_TYPES, tiny_gemma

    gemma = tiny_gemma()
    ids = context_ids(length=90, seed=7)
    seen: list[int] = []
    original = importance._RepetitionLayer.update

    def spy(self, keys, values, *args, **kwargs):
        out = original(self, keys, values, *args, **kwargs)
        seen.append(self._keys.data_ptr())
        return out

    with monkeypatch.context() as patch:
        patch.setattr(importance._RepetitionLayer, "update", spy)
        in_place = importance.reconstruction_scores(gemma, TOK, ids, chunk=30, sinks=SINKS)
    full = [i for i, kind in enumerate(GEMMA_TYPES) if kind == "full_attention"]
    assert len(seen) == 4 * len(full) and len(set(seen)) == len(full)  # 1 prefill + 3 chunks, one buffer a layer
    sliding = [i for i in range(len(GEMMA_TYPES)) if i not in full]
    assert bool(torch.isposinf(in_place[sliding]).all()) and bool(torch.isfinite(in_place[full][..., SINKS:]).all())
    with monkeypatch.context() as patch:
        patch.setattr(importance, "DynamicLayer", type("NoLayer", (), {}))  # no layer replaced: the plain copies
        copied = importance.reconstruction_scores(gemma, TOK, ids, chunk=30, sinks=SINKS)
    assert torch.allclose(in_place, copied, atol=1e-6)
    layer = importance._RepetitionLayer(room=4)
    layer.update(torch.zeros(1, 2, 10, 8), torch.zeros(1, 2, 10, 8))
    with pytest.raises(Exception, match="exceeds the 4 made room for"):
        layer.update(torch.zeros(1, 2, 5, 8), torch.zeros(1, 2, 5, 8))
