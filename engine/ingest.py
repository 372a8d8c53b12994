"""A scored context handed to a compressing cache without a second forward over it.

KVzip's scoring (:mod:`kvweave.engine.importance`) first prefills the context into a plain ``DynamicCache``, then
repeats it chunk by chunk over that cache. The keys and values of that first pass are the ones the cache's own
forward over the same tokens would store: the cache's prompt forward attends over its own tokens as they arrived
(it compresses them only after each layer's attention), so nothing of the compression reaches the hidden states of a
single prompt forward. :func:`ingest` feeds them through the cache's own ``update`` and flush, layer by layer, where a
second forward would have recomputed them (on Llama-3-8B's shape at 32K tokens, ~1.4 s of the time to first token).

It applies where the cache needs nothing else from a forward: :func:`ingest_refusal` says why not otherwise (a router
or probe recording the model's recent queries or attention, an evictor accumulating attention, token ids tapped for
delimiters, sliding-window layers where the scoring pass kept their window only, a tensor-parallel share of the
heads); the keys quantizer's query energy, where it
has one, is recorded during the scoring's context pass from the same queries the forward would have recorded.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.engine.together import Plan, flush_together, layers_a_pass, together_refusal


def ingest_refusal(cache: Any, whole_windows: bool = False) -> str | None:
    """Why ``cache`` cannot take a scored context's keys and values without a forward (None: it can). ``whole_windows``:
    the scoring pass keeps every token of sliding-window layers too (the surrogate's plain forward does; KVzip's
    repetitions run over the model's own windowed cache), so their layers can be fed as a forward would feed them."""
    engine = getattr(cache, "engine", None)
    if engine is None:
        return "not a kvweave cache"
    if engine.seq_length(0) != 0:
        return "the cache already holds tokens"
    if engine.observer.active:
        return "its router or probe records the model's recent queries during the forward"
    if engine.observer.tap is not None:
        return "it reads the prompt's token ids during the forward"
    if engine.accumulates:
        return "its evictor accumulates the forward's attention"
    if engine.sliding and not whole_windows:
        return "the model has sliding-window layers, whose scoring cache keeps their window only"
    if getattr(cache, "shard", None) is not None:
        return "it holds a tensor-parallel share of the heads"
    return None


def ingest(cache: Any, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Feed ``layers`` (per layer, keys and values [B, H, T, D] as the model's forward made them, after RoPE) into the
    empty ``cache`` as its first forward: each layer's ``update`` and, where the cache waits for the model's attention
    to flush, the call that attention would have made."""
    reason = ingest_refusal(cache, whole_windows=True)  # a windowed layer shows as a shorter token count below
    if reason is not None:
        raise ValueError(f"pipeline '{cache.pipeline.name}' cannot take a context without a forward: {reason}")
    engine = cache.engine
    if len(layers) != engine.shape.num_layers:
        raise ValueError(f"ingest: {len(layers)} layers of keys and values for a cache of {engine.shape.num_layers} layers")
    tokens = {keys.shape[-2] for keys, _ in layers}
    if len(tokens) != 1:
        raise ValueError(f"ingest: the layers hold different token counts {sorted(tokens)}" + (
            " (a sliding-window layer's scoring cache kept its window only: ingest needs every token of every layer)"
            if engine.sliding else ""))
    # one-layer groups whose flushes can go together (engine/together.py) flush a few layers at a time, in one pass
    flushing = [g for g, members in enumerate(engine.groups) if members[0] not in engine.kept_exact] if engine.settings.compress else []
    together = engine.own_attention and together_refusal(engine, flushing) is None
    batch, total = layers[0][0].shape[0], layers[0][0].shape[-2]
    per_pass = layers_a_pass(engine, total, batch, layers[0][0].device) if together else 0
    plan = Plan(flushing)  # what every layer keeps, decided at the first flush where the evictor reads no keys
    waiting: list[int] = []
    for index, (keys, values) in enumerate(layers):
        layer = cache.layers[index]
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        engine.update(index, keys, values, materialize=False)
        if not engine.own_attention:
            continue
        group = engine.group_of[index][0]
        if together and group in engine.pending:
            engine.pending.discard(group)
            waiting.append(group)
            if len(waiting) == per_pass:
                flush_together(engine, waiting, plan)
                waiting = []
        else:
            engine.after_attention(index)
    if waiting:
        flush_together(engine, waiting, plan)
