"""kvweave's cache engine: the ``transformers.Cache``, its packed store, budgets, routing, probing, eviction.

The public entry points::

    from kvweave.engine import load_pipeline, build_cache, cache_kwargs

    pipeline = load_pipeline("int4")              # from the built-in registry.toml
    cache = build_cache(pipeline, model)          # a transformers.Cache holding packed tensors
    model.generate(**inputs, **cache_kwargs(model, cache))
"""

from kvweave.core.registry import load_pipeline
from kvweave.engine.generation import cache_kwargs
from kvweave.engine.pipeline import build_cache

__all__ = ["build_cache", "cache_kwargs", "load_pipeline"]
