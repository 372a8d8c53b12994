"""Assemble a cache from a pipeline: ``build_cache(pipeline_or_name, model)``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import Registry, ResolvedPipeline, load_pipeline
from kvweave.engine.sharding import check_layer_split, detect_head_shard, layer_devices


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

    A model whose heads are sharded over tensor-parallel ranks gets a cache of this rank's KV heads (a
    pipeline that cannot work on a share of the heads is refused here); a model whose layers sit on several
    devices (``device_map``) must keep each basis group of layers on one device. See docs/scale-out.md.
    """
    if isinstance(pipeline, str):
        pipeline = load_pipeline(pipeline, registry)
    config = getattr(model, "config", model)
    shard = detect_head_shard(model) if config is not model else None
    cache = KVWeaveCache(pipeline, config, shard)
    if config is not model:
        devices = layer_devices(model, cache.shape.num_layers)
        if devices is not None:
            check_layer_split(pipeline, cache.engine.groups, devices)
        cache.bind(model, tokenizer)
    return cache
