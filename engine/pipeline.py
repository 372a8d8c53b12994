"""Assemble a cache from a pipeline: ``build_cache(pipeline_or_name, model)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import Registry, ResolvedPipeline, load_pipeline


def build_cache(
    pipeline: str | ResolvedPipeline,
    model: Any,
    registry: str | Path | Registry | None = None,
    tokenizer: Any = None,
) -> KVWeaveCache:
    """A fresh :class:`KVWeaveCache` for ``model`` (a transformers model, or only its config).

    ``pipeline`` is a resolved pipeline or a name looked up in the built-in registry (plus ``registry``,
    a user's file). Given a model, the cache is bound to it: a pipeline whose router or probe observes
    recent queries switches the model's attention to ``kvweave-observe`` (sdpa that also reports its
    queries), and a router using delimiter flags needs ``tokenizer``. Build one cache per ``generate`` call.
    """
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline, registry)
    config = getattr(model, "config", model)
    cache = KVWeaveCache(pipeline, config)
    if config is not model:
        cache.bind(model, tokenizer)
    return cache
