"""Decode steps replayed from CUDA graphs (``kvweave.engine.graphs``): greedy graph decoding gives ``model.generate``'s
tokens and stored bytes, and what cannot be replayed is refused by name (the window kept in buffers of a capacity:
tests/test_window_in_place.py). On a CPU the steps run without capture (the window's put in torch, or its kernel in
Triton's interpreter where a test asks for it); the last test captures on a GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.graphs import MIN_GRAPH_STEPS, begin_static, end_static, graph_decode, graph_refusal, steps_before_flush
from kvweave.engine.importance import score_for

from conftest import CharTokenizer, tiny_llama, write_registry
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model

FRONTIER = Path(__file__).resolve().parent.parent / "benchmarks" / "dense_sweep.toml"


def _frontier_cache(net, ids):
    registry = load_registry(FRONTIER)
    cache = build_cache(registry.resolve("kzd-k4v2-f48"), net, tokenizer=CharTokenizer())
    score_for(net, cache, ids, False, None, ingest=True)
    return cache


def _stored(cache) -> list[torch.Tensor]:
    """Every tensor the cache's packed stores and exact windows hold (codes, scales, positions), in a fixed order."""
    out = []
    for store in cache.engine.stores:
        for kind in ("keys", "values"):
            out += [t for t in store[kind].coefficients.fields.values() if isinstance(t, torch.Tensor)]
    for window in cache.engine.windows:
        out += window.exact.stored()
    return out


@pytest.mark.interpreter
def test_graph_decoding_decodes_and_stores_what_generate_does(monkeypatch):
    """The frontier pipeline (KVzip, sinks, 4-bit keys after RoPE, 2-bit values, int8 window) over a flush: the same
    tokens, bit for bit the same stored tensors, the same next-token logits; the window taken in place in every step
    between flushes that has room for a graph's block."""
    net = tiny_llama(torch.float32, hidden=256, layers=2)  # head_dim 64 (the sinks' rank)
    net.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (2, 134), generator=torch.Generator().manual_seed(1))
    new = 19  # the prompt leaves 70 exact tokens: the first token, 9 steps to the flush, one flushing, 8 more (a block each)
    reference = _frontier_cache(net, ids)
    with torch.no_grad():
        expected = net.generate(input_ids=ids, max_new_tokens=new, do_sample=False, **cache_kwargs(net, reference))[:, 134:]
    cache = _frontier_cache(net, ids)
    with torch.no_grad():
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 134:]
    puts, steps = [], []
    from kvweave.kernels import window

    original = window.put_int8
    monkeypatch.setattr("kvweave.engine.exact.put_int8", lambda *a: puts.append(1) or original(*a))
    for layer in cache.engine.windows:  # the put kernel (in the interpreter), as on a GPU; off a GPU torch puts
        layer.exact.fused = True
    before = steps_before_flush(cache.engine)
    got = graph_decode(net, cache, first, new - 1, on_step=lambda: steps.append(1))
    assert before >= MIN_GRAPH_STEPS and len(steps) == new - 1
    assert torch.equal(torch.cat((first, got), 1), expected)
    assert cache.engine.windows[0].compressed_tokens == reference.engine.windows[0].compressed_tokens > 0
    assert cache.memory_breakdown() == reference.memory_breakdown()
    assert all(torch.equal(a, b) for a, b in zip(_stored(cache), _stored(reference), strict=True))
    layers = net.config.num_hidden_layers
    assert len(puts) == 2 * layers * (before + 8)  # both kinds, every layer, the steps of both blocks but the flush
    token = got[:, -1:]
    with torch.no_grad():
        logits = [net(input_ids=token, **cache_kwargs(net, c)).logits for c in (cache, reference)]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.interpreter
def test_graph_decoding_of_a_window_kept_as_it_arrived_decodes_what_generate_does(model, registry):  # noqa: F811
    """``t-lowbit-post`` (4-bit keys after RoPE, 2-bit values, the window as the tokens arrived): over a flush, the
    same tokens and packed tensors as ``model.generate``, the windows within float32's rounding (on a CPU the torch
    twin sums over the window's buffer, zero weights past its length, in another order)."""
    model.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (2, 70), generator=torch.Generator().manual_seed(2))
    caches = [build_cache(registry.resolve("t-lowbit-post"), model) for _ in range(2)]
    with torch.no_grad():
        expected = model.generate(input_ids=ids, max_new_tokens=60, do_sample=False, **cache_kwargs(model, caches[0]))[:, 70:]
        first = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(model, caches[1]))[:, 70:]
    assert steps_before_flush(caches[1].engine) >= MIN_GRAPH_STEPS
    got = graph_decode(model, caches[1], first, 59)
    assert torch.equal(torch.cat((first, got), 1), expected)
    windows = 2 * model.config.num_hidden_layers  # the last tensors of _stored: each layer's keys and values
    stored, reference = _stored(caches[1]), _stored(caches[0])
    assert len(stored) == len(reference) and all(torch.equal(a, b) for a, b in zip(stored[:-windows], reference[:-windows]))
    for a, b in zip(stored[-windows:], reference[-windows:]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
def test_graph_decoding_stops_at_the_step_where_every_row_ended():
    net = tiny_llama(torch.float32, hidden=256, layers=2)
    net.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (2, 90), generator=torch.Generator().manual_seed(1))[1:]  # a row that decodes varied tokens
    cache = _frontier_cache(net, ids)
    with torch.no_grad():
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 90:]
    free = steps_before_flush(cache.engine)
    full = graph_decode(net, _copy_of(net, ids, first), first, 70).tolist()[0]
    stop = next(i + 1 for i in range(2, free) if full[i] not in full[:i] + first[0].tolist())  # a replayed step's token
    got = graph_decode(net, cache, first, 70, eos_token_id=[500, full[stop - 1]])
    assert got.tolist() == [full[:stop]]
    assert cache.get_seq_length() == 90 + stop  # the last token is not fed, as with model.generate
    assert graph_decode(net, cache, got[:, -1], 5, eos_token_id=full[stop - 1]).shape[1] == 0  # it ended before any step


def _copy_of(net, ids, first):
    cache = _frontier_cache(net, ids)
    with torch.no_grad():
        again = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 90:]
    assert torch.equal(again, first)
    return cache


class _Vocabulary(CharTokenizer):
    """CharTokenizer with the vocabulary a delimiter-aware router reads (depthweave-kv's)."""

    def __len__(self) -> int:
        return 128

    def batch_decode(self, ids: list[list[int]]) -> list[str]:
        return [chr(i[0]) for i in ids]


def _depthweave_stored(cache) -> list[torch.Tensor]:
    """What a ``depthweave-kv`` cache holds, in a fixed order: every layer's coefficients, residual entries (with their
    tile index) and residual bases, the basis states, the exact windows, the observer's queries and delimiter flags."""
    engine = cache.engine
    out = _stored(cache)
    for store in engine.stores:
        for kind in ("keys", "values"):
            out += [t for t in (store[kind].state or {}).values() if isinstance(t, torch.Tensor)]
    for window in engine.windows:
        for kind in ("keys", "values"):
            for rank in engine.residual_levels:
                lists = window.residuals[kind][rank]
                out += lists.stored()
            basis = window.residual_basis[kind]
            out += [basis] if basis is not None else []
    observer = engine.observer
    out += [observer.queries(layer) for layer in range(engine.shape.num_layers)] + [observer._flags]
    return out


def _flagship(pipeline: Any = "depthweave-kv", rows: int = 2):
    """A 4-layer tiny Llama (head_dim 64, one 4-layer window), ``rows`` rows of a 110-token prompt, a cache of
    ``pipeline`` (``depthweave-kv``'s by default) that holds them, and the token after them."""
    net = tiny_llama(torch.float32, hidden=256, layers=4)
    net.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (rows, 110), generator=torch.Generator().manual_seed(5))
    cache = build_cache(pipeline, net, tokenizer=_Vocabulary())
    with torch.no_grad():
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 110:]
    return net, ids, cache, first


def _generated(net, ids, pipeline: Any, new: int):
    """A fresh cache of ``pipeline`` after ``model.generate`` decoded ``new`` tokens after ``ids``, and those tokens."""
    cache = build_cache(pipeline, net, tokenizer=_Vocabulary())
    with torch.no_grad():
        tokens = net.generate(input_ids=ids, max_new_tokens=new, do_sample=False, **cache_kwargs(net, cache))
    return cache, tokens[:, ids.shape[1]:]


def test_graph_decoding_of_depthweave_kv_decodes_and_stores_what_generate_does():
    """The flagship (shared bases, int8 coefficients, routed int4 residuals, attention-output probes, the fused kernel,
    a router that reads the recent queries and delimiter flags) over a flush: the same tokens, the same stored tensors
    (observed queries and flags included), the same next-token logits. Its steps record a query a layer and a flag a
    token in place: each layer's queries move on inside their tensor, the flags go in at the window's fill."""
    net, ids, cache, first = _flagship()
    before = steps_before_flush(cache.engine)
    new = before + 12  # the steps to the flush, the flushing one, ten after
    reference, expected = _generated(net, ids, "depthweave-kv", new)
    caches = [reference, cache]
    observer, advanced = caches[1].engine.observer, []
    original = observer.advance
    observer.advance = lambda steps=1: advanced.append(steps) or original(steps)  # the steps kept in place
    got = graph_decode(net, caches[1], first, new - 1)
    assert before >= MIN_GRAPH_STEPS and caches[1].engine.windows[0].compressed_tokens > 0
    assert sum(advanced) == new - 2 and observer._static is None  # every step but the flushing one
    assert torch.equal(torch.cat((first, got), 1), expected)
    assert caches[1].memory_breakdown() == caches[0].memory_breakdown()
    stored, reference = _depthweave_stored(caches[1]), _depthweave_stored(caches[0])
    assert len(stored) == len(reference) and all(torch.equal(a, b) for a, b in zip(stored, reference))
    token = got[:, -1:]
    with torch.no_grad():
        logits = [net(input_ids=token, **cache_kwargs(net, c)).logits for c in caches[::-1]]
    assert torch.equal(logits[0], logits[1])


@pytest.mark.interpreter
def test_graph_decoding_of_depthweave_kv_by_the_triton_kernel_decodes_what_generate_does(tmp_path, monkeypatch):
    """The same with the fused Triton kernel (in Triton's interpreter), which reads the kept window to its fill on the
    device: a block of the fewest steps a graph is captured for, the same tokens as ``model.generate`` with that kernel,
    and each layer call's output the twin's over the same kept window (reading the buffers' rows past the fill fails
    it). One row of the prompt (each kernel call is slow in the interpreter): the buffers' two KV heads lie a capacity
    apart, as their rows do."""
    registry = load_registry()
    registry.add_file(write_registry(tmp_path, "triton", """
[pipelines.dw-triton]
extends = "depthweave-kv"
[pipelines.dw-triton.kernel]
backend = "triton"
"""))
    pipeline = registry.resolve("dw-triton")
    net, ids, cache, first = _flagship(pipeline, rows=1)
    assert cache.engine.windows[0].exact.shape()[:2] == (1, 2)  # one row, two KV heads
    steps = MIN_GRAPH_STEPS  # each step calls the kernel in every layer, each call slow in the interpreter
    _, expected = _generated(net, ids, pipeline, steps + 1)
    assert steps_before_flush(cache.engine) >= steps
    from kvweave.plugins.kernels import fused

    fills, errors, launch = [], [], fused.fused_decode

    def checked(view, query, start, scale, **kwargs):
        out = launch(view, query, start, scale, **kwargs)
        fills.append(view.exact_fill)
        errors.append((out.float() - fused.torch_decode(view, query, start, scale).float()).abs().max().item())
        return out

    monkeypatch.setattr(fused, "fused_decode", checked)
    got = graph_decode(net, cache, first, steps)
    assert torch.equal(torch.cat((first, got), 1), expected)
    assert len(fills) == steps * 4 and all(fill is not None for fill in fills)  # every layer call read a kept window
    assert max(errors) < 1e-3


def test_a_router_that_reads_recent_queries_needs_as_many_before_steps_are_kept_in_place():
    """``depthweave-kv`` observes 8 queries a layer; after a 5-token prompt a graph's steps could not move them on in
    place, which is refused by name, and nothing stays kept."""
    net = tiny_llama(torch.float32, hidden=256, layers=4)
    net.generation_config.eos_token_id = None
    cache = build_cache("depthweave-kv", net, tokenizer=_Vocabulary())
    ids = torch.randint(1, 128, (1, 5), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 5:]
    with pytest.raises(CacheStateError, match="fewer than the 8 observed queries"):
        graph_decode(net, cache, first, 20)
    assert cache.engine.observer._static is None and not any(w.exact.static for w in cache.engine.windows)


@pytest.mark.parametrize("name, reason", [
    ("kvzip-qa35v3", "kernel 'reference' reads the exact window's length from its shape"),
    ("t-lowbit-w8", "query energy"),
])
def test_what_cannot_be_replayed_is_refused_by_name(model, registry, name, reason):  # noqa: F811 - fixtures imported
    cache = build_cache(registry.resolve(name), model, tokenizer=_Vocabulary())
    assert reason in graph_refusal(cache)
    with pytest.raises(CacheStateError, match=f"CUDA graph decoding: pipeline '{name}'.*{reason}"):
        graph_decode(model, cache, torch.zeros(1, 1, dtype=torch.long), 3)


def test_capturing_needs_a_gpu_and_the_step_count_must_be_whole(tmp_path):
    net = tiny_llama(torch.float32, hidden=256, layers=2)
    cache = build_cache(load_registry(FRONTIER).resolve("kzd-k4v2-f48"), net, tokenizer=CharTokenizer())
    assert graph_refusal(cache) is None
    with pytest.raises(CacheStateError, match="on the CPU"):
        graph_decode(net, cache, torch.zeros(1, 1, dtype=torch.long), 3, capture=True)
    with pytest.raises(ValueError, match="steps must be >= 0"):
        graph_decode(net, cache, torch.zeros(1, 1, dtype=torch.long), -1)
    registry = load_registry(FRONTIER)
    registry.add_file(write_registry(tmp_path, "twin", """
[pipelines.g-twin]
extends = "kzd-k4v2-f48"
[pipelines.g-twin.kernel]
backend = "torch"
"""))
    twin = build_cache(registry.resolve("g-twin"), net, tokenizer=CharTokenizer())
    with pytest.raises(CacheStateError, match="backend 'torch'"):
        graph_decode(net, twin, torch.zeros(1, 1, dtype=torch.long), 3, capture=True)


@pytest.mark.interpreter
def test_windows_of_unequal_length_are_not_kept_in_place():
    net = tiny_llama(torch.float32, hidden=256, layers=2)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    cache = _frontier_cache(net, ids)
    cache.engine.windows[1].exact.drop_front("keys", 1)
    cache.engine.windows[1].exact.drop_front("values", 1)
    with pytest.raises(CacheStateError, match="one length"):
        begin_static(cache.engine, 8)
    assert not any(window.exact.static for window in cache.engine.windows)
    end_static(cache.engine)  # nothing kept: nothing to undo
