"""A scored context's one-layer flushes stored in one pass (``kvweave.engine.together``): the cache holds bit for bit
what the layer-by-layer flushes store (coefficients, residuals, slots, bytes, a question's logits), whatever the
passes (a few layers at a time, layers of different slot counts padded in one pass); the host is read once a pass
group; caches whose flushes cannot go together are named, and still ingest layer by layer."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs, importance, ingest, together

from conftest import CharTokenizer, tiny_llama
from test_ingest import _stored
from test_lowbit_kernel import registry  # noqa: F401 - the same storages

LAYERS = 6


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32, hidden=256, layers=LAYERS)  # head_dim 64, 2 KV heads


def _pipeline(registry, name):  # noqa: F811
    return registry.resolve(name) if name.startswith("t-") else load_pipeline(name)


def _ingested(model, registry, name, ids, monkeypatch=None, alone=False):  # noqa: F811
    cache = build_cache(_pipeline(registry, name), model, tokenizer=CharTokenizer())
    if alone:
        monkeypatch.setattr(ingest, "together_refusal", lambda *_: "layer by layer, for the comparison")
    with torch.no_grad():
        importance.prefill(model, cache, ids, ingest=True)
    if alone:
        monkeypatch.undo()
    return cache


@pytest.mark.parametrize("name", ["t-lowbit-sinks-kvzip", "t-lowbit-kvzip-cg", "kvzip-qa35v3"])
@pytest.mark.parametrize("per_pass, pad, one_by_one", [(None, 1.25, False), (2, 1.25, False), (None, 100.0, False), (2, 1.25, True)])
def test_flushes_stored_together_are_what_the_layer_by_layer_flushes_store(model, registry, monkeypatch, name, per_pass, pad,  # noqa: F811
                                                                           one_by_one):
    """The sinks router's fixed residuals; channel-group keys stored before RoPE; keys weighed by each layer's query
    energy (kvzip-qa35v3); passes of two layers; every layer in one pass (the smaller slot counts padded, then cut to
    their own); the layers ahead (their tokens not arrived yet) decided one at a time, each as the first layer's window
    holds its tokens."""
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(7))
    alone = _ingested(model, registry, name, ids, monkeypatch, alone=True)
    stores = []
    original = together._store

    def recording(engine, members, counts, *args):
        stores.append(list(counts))
        return original(engine, members, counts, *args)

    monkeypatch.setattr(together, "_store", recording)
    monkeypatch.setattr(together, "PAD_RATIO", pad)
    if one_by_one:
        monkeypatch.setattr(together, "DECISION_BYTES", 1 << 40)
    if per_pass is not None:  # the ingest's calls and their passes
        monkeypatch.setattr(together, "layers_a_pass", lambda *_args: per_pass)
        monkeypatch.setattr(ingest, "layers_a_pass", lambda *_args: per_pass)
    joined = _ingested(model, registry, name, ids)
    assert stores and sum(len(counts) for counts in stores) == LAYERS
    assert max(len(counts) for counts in stores) == (per_pass or LAYERS) if pad > 10 else True
    if pad > 10 and per_pass is None:
        assert len(set(stores[0])) > 1, stores  # layers keeping different counts in one pass
    assert joined.memory_breakdown() == alone.memory_breakdown()
    for a, b in zip(_stored(joined), _stored(alone)):
        assert torch.equal(a, b)
    question = torch.randint(1, 128, (1, 9), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        x = model(input_ids=question, **cache_kwargs(model, joined)).logits
        y = model(input_ids=question, **cache_kwargs(model, alone)).logits
    assert torch.equal(x, y)


@pytest.mark.parametrize("reads_keys", [False, True])
def test_storing_together_reads_the_host_once_for_the_whole_context(model, registry, monkeypatch, reads_keys):  # noqa: F811
    """kvzip reads no keys: the first call (layers 0-3) decides every layer's slots from the scores, the second (4-5)
    only stores. An evictor that reads them decides each call's layers from their keys, a host read a call; both
    store the same bytes."""
    from helpers import spy_ingest

    from kvweave.plugins.evictors.kvzip import KVzipEvictor

    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(7))
    for module in (together, ingest):  # calls of 4 and 2 layers
        monkeypatch.setattr(module, "layers_a_pass", lambda *_args: 4)
    monkeypatch.setattr(KVzipEvictor, "reads_keys", reads_keys)
    warm = _ingested(model, registry, "t-lowbit-sinks-kvzip", ids)  # one-time constants (a quantizer's levels) made
    cache = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    blocks = []
    keep = KVzipEvictor.keep
    monkeypatch.setattr(KVzipEvictor, "keep", lambda self, block: blocks.append(block.keys.shape) or keep(self, block))
    spy = spy_ingest(monkeypatch, cache)
    with torch.no_grad():
        importance.prefill(model, cache, ids, ingest=True)
    reads = {site: n for site, n in spy.sites.items() if site[0] not in ("all", "any")}
    head_dim = cache.engine.shape.head_dim
    if reads_keys:  # the slot counts of layers 0-3, then of 4-5; the deferred checks
        assert sum(reads.values()) <= 2 + 1 and reads[("tolist", "_decide")] == 2, reads
        assert [shape[0] for shape in blocks] == [4, 2] and all(shape[-1] == head_dim for shape in blocks), blocks
    else:  # every layer's slot counts; the deferred checks
        assert sum(reads.values()) <= 1 + 1 and reads[("tolist", "_decide")] == 1, reads
        assert [shape[0] for shape in blocks] == [LAYERS] and blocks[0][-1] == 0, blocks
    assert cache.memory_breakdown() == warm.memory_breakdown()
    for a, b in zip(_stored(cache), _stored(warm)):
        assert torch.equal(a, b)


def test_layers_decided_ahead_must_receive_the_tokens_they_were_decided_for(model, registry):  # noqa: F811
    from kvweave.core.errors import CacheStateError

    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(7))
    cache = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    kept: list = []
    with torch.no_grad():
        scores = importance.reconstruction_scores(model, CharTokenizer(), ids, keep=kept, energy=cache.engine.energy)
    cache.set_importance(scores)
    engine = cache.engine
    plan = together.Plan(list(range(LAYERS)))
    for layer in range(LAYERS):
        keys, values = kept[layer]
        if layer >= 3:  # the later layers given fewer tokens than the first ones
            keys, values = keys[..., :-1, :], values[..., :-1, :]
        cache.layers[layer].lazy_initialization(keys, values)
        engine.update(layer, keys, values, materialize=False)
        engine.pending.discard(layer)
    together.flush_together(engine, [0, 1, 2], plan)
    assert set(plan.slots) == set(range(LAYERS))
    with pytest.raises(CacheStateError, match=r"layers \[3, 4, 5\] hold different tokens"):
        together.flush_together(engine, [3, 4, 5], plan)


@pytest.mark.parametrize("name, why", [
    ("t-lowbit-log8", "evictor"),  # nothing evicted
    ("snapkv", "evictor"),  # chooses by the recent queries' attention
])
def test_caches_whose_flushes_cannot_go_together_say_why(model, registry, name, why):  # noqa: F811
    cache = build_cache(_pipeline(registry, name), model, tokenizer=CharTokenizer())
    assert why in (together.together_refusal(cache.engine, list(range(len(cache.engine.groups)))) or "")


def test_a_router_that_reads_the_kept_tokens_keeps_the_flushes_apart(model, registry, monkeypatch):  # noqa: F811
    """Sinks past the 4 positions kvzip always keeps: the router must read the kept tokens, so the context is stored
    layer by layer."""
    cache = build_cache(_pipeline(registry, "t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    engine = cache.engine
    object.__setattr__(engine, "router", type(engine.router)(sink_tokens=8, rank=64))
    assert "router reads the kept tokens" in (together.together_refusal(engine, list(range(LAYERS))) or "")
    called = []
    monkeypatch.setattr(ingest, "flush_together", lambda *args: called.append(args))
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        importance.prefill(model, cache, ids, ingest=True)
    assert not called and all(w.compressed_tokens > 0 for w in engine.windows)
    assert all(engine.windows[layer].residuals["keys"][64] for layer in range(LAYERS))


def test_a_pass_holds_at_most_its_bytes_of_float32_keys_and_a_gpus_pass_more_layers(model, registry):  # noqa: F811
    cache = build_cache(_pipeline(registry, "t-lowbit-kvzip-cg"), model, tokenizer=CharTokenizer())
    engine = cache.engine
    layer = engine.shape.num_kv_heads * 4096 * engine.shape.head_dim * 4  # one row of 4,096 tokens as float32
    for device, limit in ((torch.device("cpu"), together.PASS_BYTES_HOST), (torch.device("cuda"), together.PASS_BYTES)):
        per_pass = together.layers_a_pass(engine, 4096, 1, device)
        assert per_pass * layer <= limit < (per_pass + 1) * layer
    assert together.layers_a_pass(engine, 1 << 24, 1, torch.device("cpu")) == 1  # a layer alone never refused


@pytest.mark.parametrize("name", ["t-lowbit-sinks-kvzip", "t-lowbit-kvzip-cg"])  # an int8 window (its scales); a bf16 one
def test_a_non_finite_token_stored_together_is_named(model, registry, name):  # noqa: F811
    from kvweave.core.errors import CacheStateError

    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(7))
    cache = build_cache(_pipeline(registry, name), model, tokenizer=CharTokenizer())
    kept: list = []
    with torch.no_grad():
        scores = importance.reconstruction_scores(model, CharTokenizer(), ids, keep=kept, energy=cache.engine.energy)
    cache.set_importance(scores)
    keys, values = kept[3]
    values = values.clone()
    values[0, 1, 40, 5] = float("nan")
    kept[3] = (keys, values)
    with pytest.raises(CacheStateError, match=r"layer 3 sent non-finite values \(first at batch row 0, KV head 1, token 40\)"):
        ingest.ingest(cache, kept)
