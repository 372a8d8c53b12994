"""engine/copying.py (induction scores, the copying layers) and the ``kvzip`` evictor's ``keep_layers`` and ``copying``."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_registry
from kvweave.engine import copying, importance
from kvweave.engine.pipeline import build_cache
from kvweave.plugins.evictors.kvzip import KVzipEvictor

from conftest import CharTokenizer, tiny_llama, write_registry
from test_kvzip import PIPELINES as KVZIP_PIPELINES  # t-kz: kvzip keeping half of the context
from test_kvzip import SINKS, context_ids, kept_positions, make_cache
from test_kvzip import model  # noqa: F401 - the sharpened tiny model fixture

PIPELINES = KVZIP_PIPELINES + """
[pipelines.t-kz-keep-layer]
extends = "t-kz"

[pipelines.t-kz-keep-layer.evictor]
keep_layers = [1]

[pipelines.t-kz-keep-beyond]
extends = "t-kz"

[pipelines.t-kz-keep-beyond.evictor]
keep_layers = [0, 3]

[pipelines.t-cp-all]
extends = "t-kz"

[pipelines.t-cp-all.evictor]
copying = 1e-9

[pipelines.t-cp-none]
extends = "t-kz"

[pipelines.t-cp-none.evictor]
copying = 1.0
"""


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return load_registry(write_registry(tmp_path_factory.mktemp("copying"), "copying", PIPELINES))


def eager_scores(model, ids: torch.Tensor, length: int) -> torch.Tensor:
    """The same score from the eager attention's own probabilities ([B, Hq, T, T]), query heads grouped per KV head."""
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attentions = model(ids, output_attentions=True, use_cache=False).attentions
    finally:
        model.set_attn_implementation("sdpa")
    total = ids.shape[-1]
    queries = torch.arange(total - length, total - 1)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    rows = [a[:, :, queries, queries - length + 1].mean(dim=(0, 2)).reshape(-1, groups).amax(-1) for a in attentions]
    return torch.stack(rows).float()


@pytest.mark.parametrize("bos", [1, None])
def test_induction_scores_equal_the_eager_attentions_probabilities(bos):
    model = tiny_llama(layers=3)
    with torch.no_grad():  # sharpen the attention so the scores spread
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    ids = copying.random_ids(128, bos, length=24, rows=2, seed=3)
    assert ids.shape == (2, 48 + (bos is not None))
    assert torch.equal(ids[:, -48:-24], ids[:, -24:]) and int(ids[:, -48:].min()) >= 32
    ours = copying.induction_scores(model, ids, 24)
    assert ours.shape == (3, 2)
    assert torch.allclose(ours, eager_scores(model, ids, 24), atol=1e-5)
    assert float(ours.max()) > float(ours.min())  # heads differ


def test_uniform_attention_scores_the_mean_of_one_over_the_visible_keys():
    """Queries of zero give every visible key the same probability: a query at position q gives its target 1 / (q + 1),
    so the causal mask and the target positions are the ones the module's docstring names."""
    model = tiny_llama(layers=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()  # every logit 0: uniform over the visible keys
    ids = copying.random_ids(128, None, length=10, rows=1)
    expected = sum(1.0 / (q + 1) for q in range(10, 19)) / 9
    assert torch.allclose(copying.induction_scores(model, ids, 10), torch.full((2, 2), expected), atol=1e-6)


def test_short_sequences_are_refused():
    with pytest.raises(Exception, match="two copies"):
        copying.induction_scores(tiny_llama(layers=1), torch.zeros(1, 5, dtype=torch.long), 3)


def test_scores_are_computed_once_per_model_and_thresholds_pick_layers():
    model = tiny_llama(layers=3)
    first = copying.model_induction_scores(model, None)
    assert copying.model_induction_scores(model, None) is first
    top = int(first.amax(-1).argmax())
    assert copying.copying_layers(model, None, float(first.max())) == [top]
    assert copying.copying_layers(model, None, 1e-9) == [0, 1, 2]
    assert copying.copying_layers(model, None, 1.0) == []


def test_copying_threshold_keeps_the_chosen_layers_whole(registry):
    model = tiny_llama(layers=3)
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(5))
    caches = {}
    for name in ("t-kz", "t-cp-all", "t-cp-none"):
        cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
        importance.prefill(model, cache, ids)
        caches[name] = cache
    for layer, window in enumerate(caches["t-cp-all"].engine.windows):  # every layer copies at 1e-9: nothing dropped
        for head in range(2):
            assert window.positions[0, head].tolist() == list(range(window.passed_tokens)), (layer, head)
        assert len(caches["t-kz"].engine.windows[layer].positions[0, 0]) < 0.7 * window.passed_tokens  # kvzip alone drops
    assert caches["t-cp-all"].memory_bytes() > caches["t-kz"].memory_bytes()
    assert caches["t-cp-none"].memory_bytes() == caches["t-kz"].memory_bytes()  # no layer reaches 1.0


def test_the_copying_layers_are_named_when_progress_is_shown(registry, capsys):
    model = tiny_llama(layers=3)
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(6))
    importance.score_for(model, build_cache(registry.resolve("t-cp-all"), model, tokenizer=CharTokenizer()), ids, progress=True)
    assert "copying layers (induction score >= 1e-09) keep every token: 0, 1, 2" in capsys.readouterr().err
    importance.score_for(model, build_cache(registry.resolve("t-cp-none"), model, tokenizer=CharTokenizer()), ids, progress=True)
    assert "keep every token: none" in capsys.readouterr().err


# ------------------------------------------------------------------------------ keep_layers
def test_kept_layers_keep_everything_and_the_fraction_is_of_the_other_layers():
    torch.manual_seed(5)
    scores = torch.rand(4, 1, 2, 60) * torch.tensor([1.0, 8.0, 2.0, 4.0])[:, None, None, None]
    scores[..., :SINKS] = float("inf")
    scored = 60 - SINKS
    for spread in ("none", "segments"):
        for share in ("model", "layer"):
            evictor = KVzipEvictor(fraction=0.5, share=share, spread=spread, segment=16, keep_layers=(2,))
            cut = evictor.segment_cuts(scores) if spread == "segments" else evictor.cuts(scores)[..., None]
            kept = (torch.isfinite(scores) & (scores >= cut)).sum(-1)[:, 0]  # [L, H]
            assert kept[2].tolist() == [scored, scored]  # the kept layer: every scored token
            others = int(kept[[0, 1, 3]].sum())
            assert 0.5 * 3 * 2 * scored <= others <= 0.5 * 3 * 2 * scored + 3 * 2 * 4  # half of the rest, rounded up
    # the same cut as if the kept layer were not there
    alone = KVzipEvictor(fraction=0.5).cuts(scores[[0, 1, 3]])
    assert torch.equal(KVzipEvictor(fraction=0.5, keep_layers=(2,)).cuts(scores)[[0, 1, 3]], alone)


def test_a_kept_layer_stores_every_token_and_the_others_thin_more(registry, model):
    ids = context_ids()
    plain, kept = make_cache(registry, "t-kz", model), make_cache(registry, "t-kz-keep-layer", model)
    importance.prefill(model, plain, ids)
    importance.prefill(model, kept, ids)
    passed = kept.engine.windows[1].passed_tokens
    assert len(kept_positions(kept.engine.windows[1], 0)) == passed  # layer 1: nothing dropped
    assert len(kept_positions(plain.engine.windows[1], 0)) < passed
    for layer in (0, 2):  # half of the other layers' tokens
        assert 0.4 * passed <= len(kept_positions(kept.engine.windows[layer], 0)) <= 0.65 * passed
    assert kept.memory_bytes() > plain.memory_bytes()


def test_keep_layers_beyond_the_model_is_refused_naming_the_layer(registry, model):
    with pytest.raises(ModelError, match=r"keep_layers names layer\(s\) \[3\].*3 layers"):
        make_cache(registry, "t-kz-keep-beyond", model)


def test_keep_layers_are_validated():
    for bad in ([1, 1], [-1], [1.5], [True], "1"):
        with pytest.raises(ValueError, match="keep_layers"):
            KVzipEvictor(keep_layers=bad)


def test_copying_is_validated():
    for bad in (-0.1, 1.5, True, "0.3"):
        with pytest.raises(ValueError, match="copying"):
            KVzipEvictor(copying=bad)
    assert KVzipEvictor(copying=0.3).copying == 0.3
