"""Helpers shared by the test files: caches from the shared test pipelines (tests/pipelines.toml), random
prompts, prefill and greedy decode runs, and exact reference caches.

Random ids come from the global torch generator seeded with ``seed`` (``torch.manual_seed``), so a test
gets the same prompt whichever helper it calls first.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvweave.core.registry import ResolvedPipeline, load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache

from conftest import TEST_PIPELINES, ToyTokenizer

VOCAB = 128  # tiny_llama's vocabulary; id 0 is left for padding


def load_test_pipeline(name: str) -> ResolvedPipeline:
    """Pipeline ``name`` from tests/pipelines.toml (built-in names resolve too)."""
    return load_pipeline(name, TEST_PIPELINES)


def layer_tables(pipeline: ResolvedPipeline) -> dict[str, int]:
    """The slots of ``pipeline`` whose component carries a per-layer width table (``layer_bits``), with its length."""
    return {slot: len(config.component.layer_bits) for slot, config in pipeline.slots.items()
            if getattr(config.component, "layer_bits", ())}


def fit_layer_tables(pipeline: ResolvedPipeline, num_layers: int) -> ResolvedPipeline:
    """``pipeline`` with every per-layer width table written for another model cut (or repeated) to
    ``num_layers`` entries, so a pipeline tuned for a named model runs on a tiny test model."""
    slots = dict(pipeline.slots)
    for slot, length in layer_tables(pipeline).items():
        if length != num_layers:
            table = slots[slot].component.layer_bits
            fitted = tuple(table[i % length] for i in range(num_layers))
            slots[slot] = attrs.evolve(slots[slot], component=attrs.evolve(slots[slot].component, layer_bits=fitted))
    return attrs.evolve(pipeline, slots=slots)


def fit_surrogate_weights(pipeline: ResolvedPipeline, model: Any, folder: Any) -> ResolvedPipeline:
    """``pipeline`` with its ``kvzip`` evictor's surrogate weights (fitted for a named model) replaced by random ones of
    ``model``'s shape, written to ``folder``; the pipeline as it is when its evictor reads no surrogate."""
    from kvweave.engine.surrogate import FORMAT

    slot = pipeline.slots.get("evictor")
    if slot is None or getattr(slot.component, "surrogate", None) is None:
        return pipeline
    config = model.config
    layers, hidden, heads = config.num_hidden_layers, config.hidden_size, config.num_key_value_heads
    generator = torch.Generator().manual_seed(0)
    path = folder / f"surrogate-{layers}x{hidden}x{heads}.pt"
    torch.save({"format": FORMAT, "weight": torch.randn(layers, hidden, heads, generator=generator) * 0.05,
                "bias": torch.zeros(layers, heads), "scored": torch.ones(layers, dtype=torch.bool), "hidden": hidden}, path)
    slots = dict(pipeline.slots)
    slots["evictor"] = attrs.evolve(slot, component=attrs.evolve(slot.component, weights=str(path)))
    return attrs.evolve(pipeline, slots=slots)


def build_test_cache(name: str, model: Any, tokenizer: Any = None) -> KVWeaveCache:
    """A cache for ``model`` from pipeline ``name`` of tests/pipelines.toml (or a built-in one), bound to the
    model with ``tokenizer`` (default a :class:`ToyTokenizer`; only pipelines that read delimiter flags use it)."""
    return build_cache(load_test_pipeline(name), model, tokenizer=ToyTokenizer() if tokenizer is None else tokenizer)


def random_ids(batch: int = 1, length: int = 100, seed: int = 3) -> torch.Tensor:
    """Token ids [batch, length] in 1 .. VOCAB - 1, from ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return torch.randint(1, VOCAB, (batch, length))


def random_inputs(batch: int = 1, length: int = 100, seed: int = 3, pad: int = 0) -> dict[str, torch.Tensor]:
    """``generate`` inputs: :func:`random_ids` and an attention mask of ones, with the first ``pad`` tokens of
    row 0 masked (left padding; the ids stay)."""
    ids = random_ids(batch, length, seed)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def prefill(model: Any, cache: Any, ids: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
    """One forward of ``ids`` into ``cache`` (no gradients); the model's output."""
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))


def run(model: Any, cache: Any, ids: torch.Tensor, decode: int = 0) -> Any:
    """Prefill ``ids`` into ``cache``, then ``decode`` greedy one-token forwards starting from the last id;
    returns ``cache``."""
    prefill(model, cache, ids)
    token = ids[:, -1:]
    with torch.inference_mode():
        for _ in range(decode):
            token = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    return cache


def exact_cache(model: Any, ids: torch.Tensor) -> Any:
    """A transformers ``DynamicCache`` holding the exact keys and values of ``ids`` (the reference)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    prefill(model, cache, ids)
    return cache


def spy_ingest(monkeypatch, cache: KVWeaveCache):
    """The host reads (``test_graphs_warm._HostReads``, by site) of storing a scored context in ``cache``
    (:func:`kvweave.engine.importance.ingest_context`), its checks deferred as on a GPU."""
    from kvweave.engine import importance
    from test_graphs_warm import _HostReads

    cache.engine.defer_checks = True
    spy = _HostReads(twins=())
    original = importance.ingest_context

    def counted(*args):
        with spy:
            return original(*args)

    monkeypatch.setattr(importance, "ingest_context", counted)
    return spy
