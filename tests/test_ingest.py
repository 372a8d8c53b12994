"""A scored context stored from KVzip's own context pass (``kvweave.engine.ingest``), without a second forward: the
cache holds what a forward over the same tokens stores (bytes, tokens, next-token logits, greedy tokens), the
keys quantizer's query energy included; generate feeds the last prompt token only; caches that need more from a
forward are refused by name."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs, importance
from kvweave.engine.ingest import ingest, ingest_refusal

from conftest import CharTokenizer
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


@contextlib.contextmanager
def _fed_lengths(model):
    """The token count of each forward ``model`` runs within the block (a hook on its input embeddings)."""
    fed: list[int] = []
    hook = model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: fed.append(args[0].shape[-1]))
    try:
        yield fed
    finally:
        hook.remove()


def _pipeline(registry, name):
    return registry.resolve(name) if name.startswith("t-") else load_pipeline(name)


@pytest.mark.parametrize("name", ["t-lowbit-sinks-kvzip", "kvzip-qa35v3", "t-lowbit-kvzip-cg"])  # int8 windows; a bf16 window, keys before RoPE
def test_an_ingested_context_is_what_a_forward_stores(model, registry, name):  # noqa: F811
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4))
    by_forward = build_cache(_pipeline(registry, name), model, tokenizer=CharTokenizer())
    by_ingest = build_cache(_pipeline(registry, name), model, tokenizer=CharTokenizer())
    assert ingest_refusal(by_ingest) is None
    if name == "kvzip-qa35v3":
        assert by_ingest.engine.energy is not None  # channel-alloc keys weigh channels by the queries' energy
    with _fed_lengths(model) as fed:
        with torch.no_grad():
            importance.prefill(model, by_forward, ids[:, :-1])  # scored over the same 229 tokens, then a forward of them
            model(input_ids=ids[:, -1:], **cache_kwargs(model, by_forward))
            fed.clear()
            importance.prefill(model, by_ingest, ids, ingest=True)
    assert fed[-1] == 1  # the prompt's forward after ingesting: the last token only
    assert by_ingest.get_seq_length() == by_forward.get_seq_length() == 230
    assert by_ingest.memory_bytes() == by_forward.memory_bytes()
    question = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        a = model(input_ids=question, **cache_kwargs(model, by_forward)).logits
        b = model(input_ids=question, **cache_kwargs(model, by_ingest)).logits
    assert torch.allclose(a, b, atol=1e-3), (a - b).abs().max()


def test_generate_ingests_and_gives_the_tokens_of_a_forward(model, registry):  # noqa: F811
    """Greedy generation stores the whole prompt from the scoring pass and takes the first token from that pass's
    logits: no forward of the prompt follows, only the steps of the tokens after the first; the tokens are those of a
    cache filled by one forward of the prompt (which attends to itself exactly, as the scoring pass does)."""
    from kvweave.engine.generation import generate

    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(6))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    cache = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    with _fed_lengths(model) as fed:
        tokens, stats = generate(model, dict(inputs), cache, max_new_tokens=6, do_sample=False)
    assert fed[0] == 200 and fed.count(1) == 5 and fed[-5:] == [1] * 5  # the context pass, repetitions, 5 steps
    reference = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    expected = []
    with torch.no_grad():
        importance.score_for(model, reference, ids)  # scored, then one forward of the whole prompt
        step = ids
        for _ in range(6):
            out = model(input_ids=step, **cache_kwargs(model, reference))
            step = out.logits[:, -1:].argmax(-1)
            expected.append(int(step[0, 0]))
    assert tokens[0].tolist() == expected
    assert stats.prompt_tokens == 200 and stats.cached_tokens == 205
    assert cache.memory_bytes() == reference.memory_bytes()


def test_storing_a_context_with_its_sinks_restored_compares_no_layers_kept_tokens(model, registry, monkeypatch):  # noqa: F811
    """kvzip-qa35v3 (the sinks router's residuals; single-layer groups) flushed a layer at a time with the router reading
    the kept tokens, checks deferred as on a GPU: the router's parts
    are split by KV head without comparing a group's layers' kept tokens, which a one-layer group cannot differ in
    (each comparison was a host read a layer and kind)."""
    from helpers import spy_ingest
    from kvweave.engine import ingest as ingest_module
    from kvweave.plugins.evictors.kvzip import KVzipEvictor

    monkeypatch.setattr(ingest_module, "together_refusal", lambda *_: "layer by layer")  # a flush a layer
    monkeypatch.setattr(KVzipEvictor, "kept_leading", lambda self: 0)  # the router reads the kept tokens
    cache = build_cache(_pipeline(registry, "kvzip-qa35v3"), model, tokenizer=CharTokenizer())
    spy = spy_ingest(monkeypatch, cache)
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        importance.prefill(model, cache, ids, ingest=True)
    assert cache.engine.windows[0].residuals["keys"], "the sinks' residual entries were stored"
    layers = cache.shape.num_layers
    assert spy.sites[("__int__", "_kept_index")] == layers  # the kept count: a read a layer
    assert not any(name == "equal" and site != "_store" for name, site in spy.sites), spy.sites


@pytest.mark.parametrize("name, why", [("snapkv", "recent queries"), ("h2o", "accumulates")])
def test_caches_that_need_a_forward_are_refused_by_name(model, name, why):  # noqa: F811
    cache = build_cache(load_pipeline(name), model, tokenizer=CharTokenizer())
    assert why in (ingest_refusal(cache) or "")
    k = torch.zeros(1, cache.shape.num_kv_heads, 8, cache.shape.head_dim)
    with pytest.raises(ValueError, match=f"'{name}' cannot take a context without a forward: .*{why}"):
        ingest(cache, [(k, k)] * cache.shape.num_layers)
    assert cache.get_seq_length() == 0


def test_the_shipped_8x_pipeline_answers_the_same_from_an_ingested_report(real_model):
    """SmolLM2-135M (the default model), the shipped 8x KVzip pipeline, the 725-token report of examples/prompts: the
    question's logits after an ingested context equal those after scoring and forwarding the same tokens (on a CPU in
    float32 they came out bit for bit equal), with the same stored bytes."""
    model, tokenizer = real_model
    text = (Path(__file__).resolve().parents[1] / "examples" / "prompts" / "harbour-report.txt").read_text()
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    question = tokenizer("\n\nQuestion: What does the report say about the harbour's cargo?\nAnswer:", return_tensors="pt",
                         add_special_tokens=False)["input_ids"]
    logits, stored = [], []
    for ingesting in (False, True):
        cache = build_cache(load_pipeline("kvzip-qa3-vl25-smollm2"), model, tokenizer=tokenizer)
        with torch.no_grad():
            if ingesting:
                importance.prefill(model, cache, ids, ingest=True)
            else:
                importance.prefill(model, cache, ids[:, :-1])
                model(input_ids=ids[:, -1:], **cache_kwargs(model, cache))
            logits.append(model(input_ids=question, **cache_kwargs(model, cache)).logits.float())
        stored.append(cache.memory_bytes())
        assert cache.compression_ratio() > 4  # it compressed (evicted and quantized) the report
    assert stored[0] == stored[1]
    assert torch.allclose(logits[0], logits[1], atol=1e-4), (logits[0] - logits[1]).abs().max()


def test_the_quality_harness_stores_a_scored_context_as_generate_does(model, registry):  # noqa: F811
    """``kvweave eval`` (``Evaluation.answer`` with a prefilled context) ingests the scored context, as ``kvweave
    generate`` does, so quality is measured on the path users run: the prompt's forward after the scoring feeds one
    token, the question's tokens follow, and the answer is the one a scored-and-forwarded context gives."""
    from kvweave.tools.eval_context import Evaluation

    class Tok(CharTokenizer):  # what the harness reads of a tokenizer besides encoding
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return ",".join(str(int(i)) for i in ids)

    tok = Tok()
    evaluation = Evaluation(model, tok, registry, ["t-lowbit-sinks-kvzip"], None, max_new_tokens=5, chat=False,  # type: ignore[arg-type]
                            progress=False)  # no run folder: answer() writes none
    assert evaluation.pipeline("t-lowbit-sinks-kvzip") is not None
    ids = torch.randint(1, 128, (1, 210), generator=torch.Generator().manual_seed(8))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with _fed_lengths(model) as fed:
        answer, _ = evaluation.answer("t-lowbit-sinks-kvzip", inputs, context_tokens=190)
    assert fed[-6:] == [1, 20, 1, 1, 1, 1]  # after the scoring: the context's last token, the question's 20, 4 steps
    reference = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=tok)
    with torch.no_grad():
        importance.prefill(model, reference, ids[:, :189])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                             **cache_kwargs(model, reference))
    assert answer == tok.decode(out[0, 210:], skip_special_tokens=True)


def test_generate_reports_the_scorings_share_of_the_prefill(model, registry):  # noqa: F811
    """``GenerationStats.scoring_seconds``: the part of the prefill a KVzip pipeline spends scoring (and storing) the
    context, within the prefill's time; ~0 where nothing is scored."""
    from kvweave.engine.generation import generate

    ids = torch.randint(1, 128, (1, 160), generator=torch.Generator().manual_seed(9))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    scored_counts: list[int] = []
    original = importance.reconstruction_scores
    try:
        importance.reconstruction_scores = lambda *a, **k: (scored_counts.append(1), original(*a, **k))[1]
        _, kvzip = generate(model, dict(inputs), build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer()),
                            max_new_tokens=2, do_sample=False)
        _, plain = generate(model, dict(inputs), build_cache(registry.resolve("t-lowbit-sinks"), model, tokenizer=CharTokenizer()),
                            max_new_tokens=2, do_sample=False)
    finally:
        importance.reconstruction_scores = original
    assert scored_counts == [1]
    assert 0 < kvzip.scoring_seconds <= kvzip.prefill_seconds
    assert plain.scoring_seconds < 0.05 * max(plain.prefill_seconds, 1e-3) + 1e-3
    assert kvzip.to_dict()["scoring_seconds"] == kvzip.scoring_seconds


def _stored(cache) -> list[torch.Tensor]:
    """Every layer's stored tokens decoded (coefficients and residuals) and its slots' cache indices."""
    engine = cache.engine
    out = []
    for layer in range(engine.shape.num_layers):
        out += [engine.materialize(layer, kind) for kind in ("keys", "values")]
        out.append(engine.windows[layer].positions)
    return out


def test_the_sinks_an_evictor_always_keeps_get_their_ranks_without_the_router(model, registry, monkeypatch):  # noqa: F811
    """kvzip keeps its first ``sinks`` positions whatever their score (``kept_leading``), so an evicting flush's first
    slots hold them and the sinks router's ranks are known by position: the residual entries are found without calling
    the router on the kept tokens or reading the ranks to the host, and the cache stores exactly what it stores when
    the router reads them."""
    from kvweave.engine.encoder import BlockEncoder
    from kvweave.plugins.evictors.kvzip import KVzipEvictor
    from helpers import spy_ingest

    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4))
    fixed = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    spy = spy_ingest(monkeypatch, fixed)
    counted = {"rank_counts": 0}
    rank_counts = BlockEncoder.rank_counts

    def counting(self, *args):
        counted["rank_counts"] += 1
        return rank_counts(self, *args)

    monkeypatch.setattr(BlockEncoder, "rank_counts", counting)
    with torch.no_grad():
        importance.prefill(model, fixed, ids, ingest=True)
    assert counted["rank_counts"] == 0 and not any(site == "rank_counts" for _, site in spy.sites), spy.sites
    assert all(fixed.engine.windows[layer].residuals["keys"][64] for layer in range(fixed.shape.num_layers))
    monkeypatch.setattr(KVzipEvictor, "kept_leading", lambda self: 0)  # no promise: the router reads the kept tokens
    routed = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, routed, ids, ingest=True)
    assert counted["rank_counts"] > 0
    assert fixed.memory_breakdown() == routed.memory_breakdown()
    for a, b in zip(_stored(fixed), _stored(routed)):
        assert torch.equal(a, b)


def test_an_evictor_that_drops_a_position_it_promised_to_keep_is_refused(model, registry):  # noqa: F811
    from kvweave.core.errors import ComponentError

    cache = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    heads = cache.shape.num_kv_heads
    keep = torch.ones(1, 1, heads, 32, dtype=torch.bool)
    assert cache.engine.eviction._placed_leading(0, 0, keep) == 4
    assert cache.engine.eviction._placed_leading(0, 2, keep) == 2  # a block from position 2: two of the four left
    keep[0, 0, heads - 1, 1] = False
    with pytest.raises(ComponentError, match=r"promises to keep the first 4 positions .* dropped one of positions 0..3 in layers \[0\]"):
        cache.engine.eviction._placed_leading(0, 0, keep)
