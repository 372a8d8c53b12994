"""Eviction baselines as pipelines: the evictors (StreamingLLM, H2O, SnapKV, PyramidKV), alone and composed
with DepthWeave-KV's factorization (SnapKV + DepthWeave-KV).

Every property here could fail: evicted bytes really leave the cache, kept sets are what each paper
defines (checked against transformers' own eager attention where a selection depends on attention),
attention over the evicted cache equals attention over the full cache with those tokens masked, a row of
a left-padded batch gives what it gives alone, and bad settings are refused naming the pipeline, slot and
parameter."""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch
from transformers import DynamicCache

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache
from kvweave.core.errors import BudgetError, CacheStateError, KvweaveError
from kvweave.core.registry import load_pipeline
from kvweave.plugins.evictors._budget import keep_top, pool

from conftest import tiny_llama
from helpers import build_test_cache, load_test_pipeline, prefill, random_ids, random_inputs

EVICTING = ["t-stream", "t-snap", "t-pyramid", "t-h2o"]


@pytest.fixture(scope="module")
def model64():
    return tiny_llama(torch.float64)


# ------------------------------------------------------------------------------------ StreamingLLM
def test_streaming_llm_keeps_exactly_the_sinks_and_the_window(model64):
    cache = build_test_cache("t-stream", model64)
    ids = random_ids(length=100)
    prefill(model64, cache, ids)
    token = ids[:, -1:]
    with torch.inference_mode():
        for step in range(5):
            token = model64(input_ids=token, use_cache=True, **cache_kwargs(model64, cache)).logits[:, -1:].argmax(-1)
            total = 101 + step
            assert cache.get_seq_length() == total  # logical count: positions stay right
            for window in cache.engine.views():
                assert window.exact_tokens == 16  # the recent window
                assert window.positions.tolist() == [[[0, 1, 2, 3]] * 2]  # the sinks, in every head
                assert window.packed_tokens + window.exact_tokens == 20


def test_streaming_llm_sinks_are_a_padded_rows_first_real_tokens(model64):
    cache = build_test_cache("t-stream", model64)
    ids = random_ids(batch=2, length=60)
    mask = torch.ones_like(ids)
    mask[0, :7] = 0
    prefill(model64, cache, ids, mask)
    # each row of a left-padded batch is kept by an engine of its own, at its own positions (engine/rows.py)
    first, second = cache.engine.rows.engines
    for row in (first, second):
        for window in row.views():
            assert window.positions[0].tolist() == [[0, 1, 2, 3]] * 2
    assert first.seq_length(0) == 53 and second.seq_length(0) == 60  # row 0's 7 padding tokens are not stored


def test_evicted_bytes_leave_the_cache_and_memory_stays_flat(model64):
    short, long = build_test_cache("t-stream", model64), build_test_cache("t-stream", model64)
    prefill(model64, short, random_ids(length=60))
    prefill(model64, long, random_ids(length=400))
    assert short.memory_bytes() == long.memory_bytes()  # 4 sinks + 16 recent tokens either way
    full = build_cache("full", model64)
    prefill(model64, full, random_ids(length=400))
    stored = long.memory_breakdown()
    kv = stored["exact_window"] + stored["coefficients"]
    assert kv * 20 == full.memory_bytes()  # 20 of 400 tokens held, nothing else of the K/V
    assert stored["eviction"] == 3 * 1 * 2 * 4 * 2  # int16 cache index of each stored slot (eviction.position_dtype)
    assert long.compression_ratio() > 4.9  # 20x fewer tokens, stored in float64 (4x a 16-bit cache)


def test_attention_over_the_evicted_cache_equals_masked_full_attention(model64):
    ids = random_ids(length=80)
    cache = build_test_cache("t-stream", model64)
    reference = DynamicCache(config=model64.config)
    prefill(model64, cache, ids)
    prefill(model64, reference, ids)
    token = ids[:, -1:]
    with torch.inference_mode():
        for step in range(4):
            total = 81 + step
            ours = model64(input_ids=token, use_cache=True, **cache_kwargs(model64, cache)).logits
            mask = torch.zeros(1, total, dtype=torch.long)
            mask[0, :4] = 1
            mask[0, total - 17 :] = 1  # 16 recent tokens + the new one
            theirs = model64(input_ids=token, attention_mask=mask, use_cache=True, **cache_kwargs(model64, reference)).logits
            # stored tokens pass through the engine's float32 encoding: float32 rounding, nothing more
            assert torch.allclose(ours, theirs, atol=1e-6), (ours - theirs).abs().max()
            token = ours[:, -1:].argmax(-1)


# ------------------------------------------------------------------------------------ batches
@pytest.mark.parametrize("name", EVICTING)
def test_a_left_padded_row_gives_what_it_gives_alone(model64, name):
    ids = random_ids(batch=2, length=90, seed=5)
    mask = torch.ones_like(ids)
    mask[0, :13] = 0
    options = dict(max_new_tokens=12, do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    batch = model64.generate(input_ids=ids, attention_mask=mask, **options, **cache_kwargs(model64, build_test_cache(name, model64)))
    alone = model64.generate(input_ids=ids[:1, 13:], **options, **cache_kwargs(model64, build_test_cache(name, model64)))
    assert torch.equal(batch.sequences[0, 90:], alone.sequences[0, 77:])
    for a, b in zip(batch.scores, alone.scores):
        assert torch.allclose(a[0], b[0], atol=1e-9)


def test_batch_reordering_moves_positions_and_scores(model64):
    cache = build_test_cache("t-h2o", model64)
    prefill(model64, cache, random_ids(batch=2, length=70))
    before = [(w.positions.clone(), w.scores.clone()) for w in cache.engine.views()]
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    for (positions, scores), window in zip(before, cache.engine.views()):
        assert torch.equal(window.positions, positions[[1, 0, 1]])
        assert torch.equal(window.scores, scores[[1, 0, 1]])


# ------------------------------------------------------------------------------------ SnapKV, PyramidKV
def _eager_votes(ids, window, count):
    """Observation-window votes from transformers' own eager attention weights: [L, B, H, count]."""
    reference = tiny_llama(torch.float64)
    reference.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = reference(input_ids=ids, output_attentions=True).attentions
    votes = []
    for probs in attentions:  # [B, Hq, T, T]
        batch, q_heads = probs.shape[:2]
        grouped = probs[:, :, -window:, :count].reshape(batch, 2, q_heads // 2, window, count)
        votes.append(grouped.sum(dim=(2, 3)))
    return torch.stack(votes)


def test_snapkv_keeps_the_top_pooled_votes_of_the_observation_window(model64):
    ids = random_ids(length=120, seed=7)
    cache = build_test_cache("t-snap", model64)
    prefill(model64, cache, ids)
    votes = pool(_eager_votes(ids, window=8, count=112), 5, "avg")
    for layer, window in enumerate(cache.engine.views()):
        assert window.packed_tokens == 24 - 8 and window.exact_tokens == 8
        expected = votes[layer].topk(16, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(window.positions.long().sort(dim=-1).values, expected)
    heads = [set(map(tuple, w.positions[0].tolist())) for w in cache.engine.views()]
    assert any(len(h) > 1 for h in heads)  # heads choose their own tokens


def test_snapkv_keeps_generated_tokens_and_frees_the_prompt(model64):
    cache = build_test_cache("t-snap", model64)
    prefill(model64, cache, random_ids(length=120))
    token = torch.tensor([[5]])
    with torch.inference_mode():
        for _ in range(6):
            token = model64(input_ids=token, use_cache=True, **cache_kwargs(model64, cache)).logits[:, -1:].argmax(-1)
    window = cache.engine.views()[0]
    assert window.packed_tokens == 16 + 6 and window.positions[0, 0, -6:].tolist() == list(range(112, 118))
    full = build_cache("full", model64)
    prefill(model64, full, random_ids(length=126))
    stored = cache.memory_breakdown()
    assert (stored["exact_window"] + stored["coefficients"]) * 126 == full.memory_bytes() * 30


def test_snapkv_shares_its_budget_between_prompt_chunks(model64):
    cache = build_test_cache("t-snap", model64)
    ids = random_ids(length=120, seed=2)
    prefill(model64, cache, ids[:, :60])
    first = [set(w.positions[0, 0].tolist()) for w in cache.engine.views()]
    assert all(len(kept) == 16 and max(kept) < 52 for kept in first)
    prefill(model64, cache, ids[:, 60:])  # a second chunk: the 24-token budget is already spent
    for window, kept in zip(cache.engine.views(), first):
        assert window.packed_tokens == 16 and window.exact_tokens == 8
        assert set(window.positions[0, 0].tolist()) == kept
    assert cache.get_seq_length() == 120


def test_pyramidkv_budgets_fall_with_depth_and_average_the_budget():
    model = tiny_llama(torch.float64, layers=5)
    cache = build_test_cache("t-pyramid", model)
    prefill(model, cache, random_ids(length=150))
    kept = [w.packed_tokens + w.exact_tokens for w in cache.engine.views()]
    assert all(a > b for a, b in zip(kept, kept[1:])), kept
    assert abs(sum(kept) / len(kept) - 24) <= 1
    assert kept[-1] == 8 + round(16 / 4)  # the window plus (budget - window) / beta


def test_keep_top_skips_padding_and_keeps_per_row_counts():
    scores = torch.tensor([[[[5.0, 4.0, 3.0, 2.0, 1.0]], [[1.0, 2.0, 3.0, 4.0, 5.0]]]])  # [1, 2, 1, 5]
    valid = torch.tensor([[[[False, True, True, True, True]], [[True, True, True, True, True]]]])
    keep = keep_top(scores, valid, torch.tensor([2, 1]))
    assert keep[0, 0, 0].tolist() == [False, True, True, False, False]
    assert keep[0, 1, 0].tolist() == [False, False, False, False, True]


# ------------------------------------------------------------------------------------ H2O
def test_h2o_holds_a_fixed_budget_and_evicts_stored_tokens(model64):
    cache = build_test_cache("t-h2o", model64)
    prefill(model64, cache, random_ids(length=90))
    sizes = []
    token = torch.tensor([[9]])
    with torch.inference_mode():
        for _ in range(6):
            token = model64(input_ids=token, use_cache=True, **cache_kwargs(model64, cache)).logits[:, -1:].argmax(-1)
            sizes.append(cache.memory_bytes())
    assert len(set(sizes)) == 1  # the budget holds at every step
    assert all(w.packed_tokens == 12 and w.exact_tokens == 8 for w in cache.engine.views())
    # a token about to leave the window that has received more attention than a stored heavy hitter
    # replaces it: stored tokens are re-selected at every step
    window = cache.engine.views()[1]
    leaving = window.passed_tokens
    weakest = window.scores[0, 0, :12].argmin()
    dropped = int(window.positions[0, 0, weakest])
    with torch.inference_mode():  # the view's tensors are the stored ones: this raises the leaving token's score
        window.scores[0, 0, 12] = window.scores[0, 0, :12].max() + 1.0
        model64(input_ids=token, use_cache=True, **cache_kwargs(model64, cache))
    window = cache.engine.view(1)  # a view is a snapshot of what is stored now
    kept = set(window.positions[0, 0].tolist())
    assert leaving in kept and dropped not in kept and len(kept) == 12
    assert leaving not in set(window.positions[0, 1].tolist())  # the other head decided on its own scores


def test_h2o_keeps_the_tokens_with_the_most_accumulated_attention_atprefill(model64):
    ids = random_ids(length=60, seed=11)
    cache = build_test_cache("t-h2o", model64)
    prefill(model64, cache, ids)
    reference = tiny_llama(torch.float64)
    reference.set_attn_implementation("eager")
    with torch.inference_mode():
        attentions = reference(input_ids=ids, output_attentions=True).attentions
    for layer, window in enumerate(cache.engine.views()):
        received = attentions[layer][0].reshape(2, 2, 60, 60).sum(dim=(1, 2))[:, :52]  # [H, 52] all queries
        expected = received.topk(12, dim=-1).indices.sort(dim=-1).values
        assert torch.equal(window.positions[0].long().sort(dim=-1).values, expected)


# ------------------------------------------------------------------------------------ composed
def test_snapkv_depthweave_factorizes_only_the_kept_tokens():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    ids = random_ids(batch=2, length=600)
    caches = {name: build_test_cache(name, model) for name in ("t-snap-dw", "t-dw", "t-snap-wide")}
    for cache in caches.values():
        prefill(model, cache, ids)
    composed = caches["t-snap-dw"]
    kept = caches["t-snap-wide"].engine.views()[0]
    for layer, window in enumerate(composed.engine.views()):
        assert 0 < window.packed_tokens < 600 - window.exact_tokens
        # one selection per window of 2 layers (their tokens share coefficient rows)
        partner = composed.engine.views()[layer ^ 1]
        assert torch.equal(window.positions, partner.positions)
        for kind in (window.keys, window.values):
            for residuals in kind.residuals:
                if residuals.entries:
                    assert int(residuals.located()[1].max()) < window.packed_tokens
    assert composed.memory_bytes() < caches["t-dw"].memory_bytes()
    assert composed.memory_bytes() < caches["t-snap-wide"].memory_bytes()
    assert kept.packed_tokens > 0
    breakdown = composed.memory_breakdown()
    assert breakdown["coefficients"] > 0 and breakdown["basis_state"] > 0
    out = model.generate(input_ids=ids[:1, :200], max_new_tokens=5, do_sample=False, pad_token_id=0,
                         **cache_kwargs(model, build_test_cache("t-snap-dw", model)))
    assert out.shape == (1, 205)


# ------------------------------------------------------------------------------------ errors
def test_a_budget_smaller_than_the_window_is_refused_naming_pipeline_slot_and_parameter(model64):
    with pytest.raises(BudgetError, match=r"pipeline 't-snap-bad', slot 'evictor' \('snapkv'\): 'budget' = 5 tokens"):
        build_test_cache("t-snap-bad", model64)


def test_an_evictor_named_in_the_router_slot_is_refused_listing_the_routers(test_registry):
    with pytest.raises(KvweaveError, match=r"t-router-drops', slot 'router': unknown routers component 'snapkv'; available: .*sigmoid-multilevel"):
        load_pipeline("t-router-drops", test_registry)


def test_budget_and_fraction_together_are_refused(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text('[pipelines.x]\nextends = "snapkv"\n[pipelines.x.evictor]\nbudget = 64\n')
    with pytest.raises(KvweaveError, match=r"pipeline 'x', slot 'evictor'.*either 'budget'.*or 'fraction'"):
        load_pipeline("x", path)


def test_an_evicting_cache_on_an_unbound_model_stops_with_a_clear_error():
    model = tiny_llama(torch.float64)
    cache = KVWeaveCache(load_test_pipeline("t-stream"), model.config)  # the model's attention is plain sdpa
    with torch.inference_mode():
        model(input_ids=random_ids(length=40), use_cache=True, **cache_kwargs(model, cache))
        with pytest.raises(CacheStateError, match="build_cache"):
            model(input_ids=torch.tensor([[3]]), use_cache=True, **cache_kwargs(model, cache))


# ------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("name", ["streaming-llm", "h2o", "snapkv", "pyramidkv"])
def test_each_baseline_pipeline_generates_on_a_tiny_model(name):
    model = tiny_llama()
    inputs = random_inputs(batch=2, length=260, pad=30)
    cache = build_cache(name, model)
    out = model.generate(**inputs, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         **cache_kwargs(model, cache))
    assert out.shape == (2, 266)
    assert cache.get_seq_length() == 265
    assert 0 < cache.memory_bytes() < cache.full_cache_bytes_16bit() * 2  # float32 model: a full cache is 2x


@pytest.mark.model
def test_snapkv_generate_on_the_default_model_through_the_cli(capsys):
    from kvweave.tools.cli import main

    with mock.patch.dict(os.environ):  # the command sets the CUDA allocator's variable for the rest of the process
        code = main(["generate", "--pipeline", "snapkv", "--prompt", "The harbour opened at dawn. " * 40 + "When did the harbour open?",
                     "--max-new-tokens", "8", "--dtype", "bfloat16"])
    out = capsys.readouterr()
    assert code == 0, out.err
    ratio = float(out.out.split("ratio")[1].split("x")[0])
    assert ratio > 3
