"""The ``kvzip`` evictor's surrogate scorer (engine/surrogate.py, tools/scorer_fit.py): scores from one forward.

Every property here could fail: the fit recovers a map the scores were made from (a transposed or misaligned
solve does not), the scores are each layer's attention input through its own map (sinks and unscored layers at
+inf), a surrogate cache reads its context in one forward and ingests it, keeping the tokens the evictor's cut
over the predicted scores names, and bad weights or settings are refused naming what is wrong."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, copying, importance, surrogate
from kvweave.engine.taps import HiddenTap
from kvweave.plugins.evictors.kvzip import KVzipEvictor
from kvweave.tools import scorer_fit

from conftest import write_registry
from test_ingest import _fed_lengths
from test_kvzip import SINKS, TOK, context_ids, kept_positions, record_importance
from test_kvzip import model  # noqa: F401 - the sharpened tiny model fixture (3 layers, 2 KV heads, hidden 64)

LAYERS, HEADS, HIDDEN = 3, 2, 64


def weights_dict(seed: int = 0, scored=(True, True, True)) -> dict:
    generator = torch.Generator().manual_seed(seed)
    return {"format": surrogate.FORMAT, "weight": torch.randn(LAYERS, HIDDEN, HEADS, generator=generator),
            "bias": torch.randn(LAYERS, HEADS, generator=generator), "scored": torch.tensor(scored), "hidden": HIDDEN}


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("surrogate") / "tiny.pt"
    torch.save(weights_dict(), path)
    return path


@pytest.fixture(scope="module")
def registry(tmp_path_factory, weights_file):
    text = f"""
[pipelines.t-sg]
extends = "full"
compress = true
recent_window = 16
block_tokens = 16

[pipelines.t-sg.evictor]
use = "kvzip"
fraction = 0.5
scorer = "surrogate"
weights = "{weights_file}"

[pipelines.t-sg-cg]
extends = "t-sg"

[pipelines.t-sg-cg.keys.quantizer]
use = "channel-group"
bits = 4
group = 16

[pipelines.t-sg-copying]
extends = "t-sg"

[pipelines.t-sg-copying.evictor]
copying = 0.3
"""
    return load_registry(write_registry(tmp_path_factory.mktemp("sg-registry"), "sg", text))


# ------------------------------------------------------------------------------------------------ the fit
def test_the_fit_recovers_the_map_the_scores_were_made_from(monkeypatch, tmp_path):
    """Windows whose KVzip scores are exp(h W + b) exactly: the ridge-free fit gives W and b back, and on the held-out
    window the predictions correlate 1 and keep KVzip's kept set whole. A sliding layer (scores +inf) is not fitted."""
    truth = weights_dict(seed=5, scored=(True, False, True))
    truth["weight"] *= 0.1  # logs of -10 to 5: no score under surrogate.FLOOR
    generator = torch.Generator().manual_seed(1)

    def fake_record(_model, _tokenizer, ids, _chunk, sinks):
        states = {layer: torch.randn(ids.numel(), HIDDEN, generator=generator) for layer in range(LAYERS)}
        scores = torch.full((LAYERS, HEADS, ids.numel()), math.inf)
        for layer in (0, 2):
            scores[layer] = (states[layer] @ truth["weight"][layer] + truth["bias"][layer]).T.exp()
        scores[..., :sinks] = math.inf
        return states, scores

    monkeypatch.setattr(scorer_fit, "_record", fake_record)
    monkeypatch.setattr(scorer_fit, "model_induction_scores", lambda _model, _bos: torch.zeros(LAYERS, HEADS))
    windows = [torch.arange(120) for _ in range(4)]
    data = scorer_fit.fit_surrogate(SimpleNamespace(device=torch.device("cpu")), None, windows, ridge=0.0, sinks=SINKS)
    assert data["scored"].tolist() == [True, False, True]
    for layer in (0, 2):
        torch.testing.assert_close(data["weight"][layer], truth["weight"][layer], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(data["bias"][layer], truth["bias"][layer], atol=1e-4, rtol=1e-4)
    assert not data["weight"][1].any()
    assert data["held_out"]["pearson"] == pytest.approx(1.0, abs=1e-6)
    assert data["held_out"]["kept_overlap"] == pytest.approx(1.0)
    assert data["tokens"] == 3 * (120 - SINKS) and data["windows"] == 3
    scorer_fit.save_atomic(tmp_path / "fitted.pt", data)
    loaded = surrogate.load_surrogate(str(tmp_path / "fitted.pt"))
    torch.testing.assert_close(loaded["weight"], data["weight"])


def test_the_fit_on_a_model_takes_kvzips_own_scores_of_each_window(model):  # noqa: F811
    """On the sharpened tiny model, the fit from real KVzip scores: every layer scored, finite weights, and the held-out
    figures are the predictions' against KVzip's scores of the held-out window, recomputed here."""
    windows = [context_ids(length=96, seed=s)[0] for s in range(3)]
    data = scorer_fit.fit_surrogate(model, TOK, windows, chunk=64, sinks=SINKS, ridge=1e-3)
    assert data["scored"].all() and torch.isfinite(data["weight"]).all()
    states: dict = {}
    with HiddenTap(model, lambda layer, h: states.__setitem__(layer, h[0].float())):
        target = importance.reconstruction_scores(model, TOK, windows[-1][None], chunk=64, sinks=SINKS)[:, 0]
    predicted = torch.stack([(states[l] @ data["weight"][l] + data["bias"][l]).T for l in range(LAYERS)])
    target = target.clamp_min(surrogate.FLOOR).log()
    figures = scorer_fit.held_out_figures(predicted, target, [True] * LAYERS, 0.5)
    assert figures["pearson"] == pytest.approx(data["held_out"]["pearson"], abs=1e-5)
    assert figures["kept_overlap"] == pytest.approx(data["held_out"]["kept_overlap"], abs=1e-9)
    assert figures["entries"] == LAYERS * HEADS * (96 - SINKS)
    torch.testing.assert_close(data["induction"], copying.model_induction_scores(model, None))


def test_the_copying_layers_come_from_the_induction_scores_kept_with_the_map(model, registry, monkeypatch):  # noqa: F811
    """A surrogate that carries the model's induction scores names the copying layers from them, without the probe:
    the layers whose best KV head reaches the threshold keep every token (+inf)."""
    cache = build_cache(registry.resolve("t-sg-copying"), model, tokenizer=TOK)
    induction = torch.tensor([[0.1, 0.2], [0.05, 0.6], [0.31, 0.0]])
    cache.engine.evictor.surrogate["induction"] = induction
    monkeypatch.setattr(importance, "copying_layers", lambda *a: pytest.fail("the probe ran"))
    seen = record_importance(cache)
    try:
        importance.score_for(model, cache, context_ids(length=120))
    finally:
        del cache.engine.evictor.surrogate["induction"]
    scores = seen["scores"]
    assert [bool(torch.isposinf(scores[layer]).all()) for layer in range(LAYERS)] == [False, True, True]


# --------------------------------------------------------------------------------------------- the scores
@pytest.mark.parametrize("chunk", [None, 7 * 2 * HIDDEN])  # the whole prompt at once; 7 tokens a product (50 = 7 x 7 + 1)
def test_scores_are_each_layers_attention_input_through_its_map(model, chunk, monkeypatch):  # noqa: F811
    if chunk:
        monkeypatch.setattr(surrogate, "CHUNK_ELEMENTS", chunk)
    data = weights_dict(scored=(True, False, True))
    ids = context_ids(batch=2, length=50)
    inputs: dict = {}
    with HiddenTap(model, lambda layer, h: inputs.__setitem__(layer, h.float())), torch.no_grad():
        model(input_ids=ids)
    kept: list = []
    scores = surrogate.surrogate_scores(model, ids, data, sinks=SINKS, keep=kept)
    assert scores.shape == (LAYERS, 2, HEADS, 50) and scores.dtype == torch.float32
    for layer in (0, 2):
        expect = (inputs[layer] @ data["weight"][layer] + data["bias"][layer]).transpose(1, 2)
        torch.testing.assert_close(scores[layer, ..., SINKS:], expect[..., SINKS:])
    assert torch.isposinf(scores[1]).all() and torch.isposinf(scores[..., :SINKS]).all()
    assert len(kept) == LAYERS and kept[0][0].shape == (2, HEADS, 50, HIDDEN // 4)


def test_a_surrogate_cache_reads_its_context_in_one_forward_and_keeps_the_cut_of_the_predictions(model, registry):  # noqa: F811
    ids = context_ids(length=200)
    cache = build_cache(registry.resolve("t-sg"), model, tokenizer=TOK)
    seen = record_importance(cache)
    with _fed_lengths(model) as fed, torch.no_grad():
        importance.prefill(model, cache, ids, ingest=True)
    assert fed == [199, 1]  # the context once (no repetition), then the last token by the caller's forward
    evictor = cache.engine.evictor
    expect = surrogate.surrogate_scores(model, ids[:, :-1], evictor.surrogate, sinks=SINKS)
    torch.testing.assert_close(seen["scores"], expect)
    cuts = evictor.cuts(expect, cache.engine.windows[0].exact_tokens)
    for layer, window in enumerate(cache.engine.windows):
        passed = window.passed_tokens
        assert passed > 0
        for head in range(HEADS):
            kept = kept_positions(window, head)
            assert kept == [p for p in range(passed) if expect[layer, 0, head, p] >= cuts[layer, 0, head]]
            assert kept[:SINKS] == list(range(SINKS)) and len(kept) < passed


@pytest.mark.parametrize("sliding_tokens", [0, 24])  # the model's windows kept whole (39 tokens), or shortened
def test_a_surrogate_cache_of_a_model_with_sliding_windows_ingests_what_a_forward_stores(tmp_path, sliding_tokens):
    """Toy Gemma 3 (two sliding-window layers of 40 tokens before each full-attention one): the surrogate's scoring
    pass keeps every layer's whole context, so the cache takes it without a second forward and holds what scoring
    then a forward over the same tokens store (bytes, tokens, the question's logits). KVzip's repetitions run over the
    model's windowed cache, so its pipeline still reads the context in a forward of its own."""
    from conftest import GEMMA_TYPES, CharTokenizer, tiny_gemma
    from kvweave.engine import cache_kwargs
    from kvweave.engine.ingest import ingest, ingest_refusal

    gemma = tiny_gemma()
    scored = torch.tensor([kind == "full_attention" for kind in GEMMA_TYPES])
    generator = torch.Generator().manual_seed(3)
    torch.save({"format": surrogate.FORMAT, "weight": torch.randn(len(GEMMA_TYPES), 128, 2, generator=generator) * 0.1,
                "bias": torch.zeros(len(GEMMA_TYPES), 2), "scored": scored, "hidden": 128}, tmp_path / "gemma.pt")
    registry = load_registry(write_registry(tmp_path, "gemma-sg", f"""
[pipelines.g-sg]
extends = "full"
compress = true
recent_window = 16
block_tokens = 16
sliding_tokens = {sliding_tokens}

[pipelines.g-sg.evictor]
use = "kvzip"
fraction = 0.5
scorer = "surrogate"
weights = "{tmp_path / 'gemma.pt'}"

[pipelines.g-kz]
extends = "g-sg"

[pipelines.g-kz.evictor]
scorer = "reconstruction"
weights = ""
"""))
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(8))
    by_forward = build_cache(registry.resolve("g-sg"), gemma, tokenizer=CharTokenizer())
    by_ingest = build_cache(registry.resolve("g-sg"), gemma, tokenizer=CharTokenizer())
    assert "sliding-window" in ingest_refusal(by_ingest) and ingest_refusal(by_ingest, whole_windows=True) is None
    with _fed_lengths(gemma) as fed, torch.no_grad():
        importance.prefill(gemma, by_forward, ids[:, :-1])  # scored over the same 149 tokens, then a forward of them
        gemma(input_ids=ids[:, -1:], **cache_kwargs(gemma, by_forward))
        assert fed == [149, 149, 1]
        fed.clear()
        importance.prefill(gemma, by_ingest, ids, ingest=True)
        assert fed == [149, 1]  # the context once, then the last token by the caller's forward
    assert by_ingest.get_seq_length() == by_forward.get_seq_length() == 150
    assert by_ingest.memory_bytes() == by_forward.memory_bytes()
    windows = by_ingest.engine.windows
    assert all(windows[layer].exact_tokens == (sliding_tokens or 39) for layer in by_ingest.engine.sliding)
    full = [layer for layer, kind in enumerate(GEMMA_TYPES) if kind == "full_attention"]
    assert all(windows[layer].compressed_tokens + windows[layer].exact_tokens < 150 for layer in full)  # evicted
    question = torch.randint(1, 128, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = gemma(input_ids=question, **cache_kwargs(gemma, by_forward)).logits
        b = gemma(input_ids=question, **cache_kwargs(gemma, by_ingest)).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    windowed = build_cache(registry.resolve("g-sg"), gemma, tokenizer=CharTokenizer())
    short = torch.zeros(1, 2, 39, 64)
    with pytest.raises(ValueError, match="different token counts .* sliding-window layer's scoring cache kept its window"):
        ingest(windowed, [(short, short) if kind == "sliding_attention" else (torch.zeros(1, 2, 149, 64),) * 2 for kind in GEMMA_TYPES])
    kvzip = build_cache(registry.resolve("g-kz"), gemma, tokenizer=CharTokenizer())
    with _fed_lengths(gemma) as fed, torch.no_grad():
        importance.prefill(gemma, kvzip, ids, ingest=True)
    assert 150 in fed  # the prompt's own forward after KVzip's passes
    # greedy generation: the context read once, the first token from that pass, the tokens of a forward-filled cache
    from kvweave.engine.generation import generate

    whole = build_cache(registry.resolve("g-sg"), gemma, tokenizer=CharTokenizer())
    with _fed_lengths(gemma) as fed:
        tokens, _ = generate(gemma, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, whole, max_new_tokens=4,
                             do_sample=False)
    assert fed == [150, 1, 1, 1]
    reference = build_cache(registry.resolve("g-sg"), gemma, tokenizer=CharTokenizer())
    expected, step = [], ids
    with torch.no_grad():
        importance.score_for(gemma, reference, ids)
        for _ in range(4):
            step = gemma(input_ids=step, **cache_kwargs(gemma, reference)).logits[:, -1:].argmax(-1)
            expected.append(int(step[0, 0]))
    assert tokens[0].tolist() == expected and whole.memory_bytes() == reference.memory_bytes()


def test_storing_a_scored_context_reads_the_host_once_for_its_slots(model, registry, monkeypatch):  # noqa: F811
    """With checks deferred as on a GPU, the flushes of an ingested context, stored together (engine/together.py), read
    the device once for every layer's slot count, once a layer for whether the slot index's bits hold its positions,
    and once for the deferred checks: the cuts, the top-up to whole token groups and a block scored +inf throughout
    read nothing."""
    from helpers import spy_ingest

    cache = build_cache(registry.resolve("t-sg-cg"), model, tokenizer=TOK)  # keys in groups of 16 tokens: topped up
    spy = spy_ingest(monkeypatch, cache)
    with torch.no_grad():
        importance.prefill(model, cache, context_ids(length=200), ingest=True)
    assert all(w.compressed_tokens < w.passed_tokens and w.compressed_tokens % 16 == 0 for w in cache.engine.windows)
    reads = {site: n for site, n in spy.sites.items() if site[0] not in ("all", "any")}  # a tensor, unless bool() reads it
    assert sum(reads.values()) <= LAYERS + 2, reads
    assert sum(n for (name, _), n in reads.items() if name == "tolist") == 1, reads
    assert not any(site in ("keep", "_whole_groups", "cuts", "_every_cut") for _, site in reads), reads


# ------------------------------------------------------------------------------------------------ refusals
def test_bad_settings_and_files_are_refused_naming_what(tmp_path, weights_file):
    with pytest.raises(ValueError, match="needs 'weights'"):
        KVzipEvictor(scorer="surrogate")
    with pytest.raises(ValueError, match="read by scorer = 'surrogate' only"):
        KVzipEvictor(weights=str(weights_file))
    with pytest.raises(ValueError, match="does not exist"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "missing.pt"))
    with pytest.raises(ValueError, match="unknown shipped surrogate 'nope'"):
        KVzipEvictor(scorer="surrogate", weights="builtin:nope")
    torch.save({"format": "something-else"}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="is not a kvweave surrogate"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "other.pt"))
    (tmp_path / "text.pt").write_text("not a pickle")
    with pytest.raises(ValueError, match="is not a kvweave surrogate"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "text.pt"))
    bad = weights_dict()
    bad["bias"] = torch.zeros(LAYERS, HEADS + 1)
    torch.save(bad, tmp_path / "bad.pt")
    with pytest.raises(ValueError, match="do not agree"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "bad.pt"))
    bad = weights_dict()
    bad["induction"] = torch.zeros(LAYERS, HEADS + 1)
    torch.save(bad, tmp_path / "induction.pt")
    with pytest.raises(ValueError, match=r"induction scores must be \[L, H\]"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "induction.pt"))
    bad = weights_dict()
    bad["weight"][0, 0, 0] = math.nan
    torch.save(bad, tmp_path / "nan.pt")
    with pytest.raises(ValueError, match="non-finite"):
        KVzipEvictor(scorer="surrogate", weights=str(tmp_path / "nan.pt"))


def test_weights_of_another_model_are_refused_at_the_cache_and_at_the_forward(model, weights_file):  # noqa: F811
    evictor = KVzipEvictor(scorer="surrogate", weights=str(weights_file))
    evictor.check_model(ModelShape(num_layers=LAYERS, num_query_heads=4, num_kv_heads=HEADS, head_dim=16))
    with pytest.raises(ModelError, match="fitted for 3 layers x 2 KV heads"):
        evictor.check_model(ModelShape(num_layers=4, num_query_heads=4, num_kv_heads=HEADS, head_dim=16))
    with pytest.raises(ModelError, match=r"layer\(s\) \[1\] are scored where the model keeps a sliding window"):
        evictor.check_model(ModelShape(num_layers=LAYERS, num_query_heads=4, num_kv_heads=HEADS, head_dim=16,
                                       layer_windows=(0, 32, 0)))
    data = weights_dict()
    data["weight"] = torch.zeros(LAYERS, HIDDEN + 1, HEADS)
    with pytest.raises(ModelError, match="hidden states of 65; layer 0 reads 64"):
        surrogate.surrogate_scores(model, context_ids(length=20), data)


def test_the_shipped_surrogate_fits_the_default_models_shape():
    """SmolLM2-135M-Instruct: 30 layers, 3 KV heads, hidden 576, every layer scored (no sliding window)."""
    evictor = KVzipEvictor(scorer="surrogate", weights="builtin:smollm2-135m-instruct")
    evictor.check_model(ModelShape(num_layers=30, num_query_heads=9, num_kv_heads=3, head_dim=64))
    data = evictor.surrogate
    assert data["hidden"] == 576 and data["scored"].all()
    assert data["held_out"]["kept_overlap"] > 0.5  # better than a random cut at fraction 0.5


@pytest.mark.parametrize("argv, message", [
    (["--samples", "1"], "--samples must be at least 2"),
    (["--ridge", "-1"], "--ridge must be a finite number >= 0"),
    (["--ridge", "nan"], "--ridge must be a finite number >= 0"),
    (["--fraction", "1"], "--fraction must lie in (0, 1)"),
    (["--text-file", "/nonexistent/essays.txt"], "does not exist"),
])
def test_train_scorer_refuses_bad_arguments_before_loading_a_model(argv, message, capsys, monkeypatch):
    from kvweave.tools import cli, models

    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("a model was loaded"))
    assert cli.main(["train-scorer", *argv]) == 2
    assert message in capsys.readouterr().err
