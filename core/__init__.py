"""kvweave's engine: hook specs, plugin manager, component interfaces, registry, cache, CLI.

The public entry points::

    from kvweave.core import load_pipeline, build_cache

    pipeline = load_pipeline("int4")              # from the built-in registry.toml
    cache = build_cache(pipeline, model)          # a transformers.Cache holding packed tensors
    model.generate(**inputs, **cache_kwargs(model, cache))
"""

from .hookspecs import hookimpl

__all__ = ["hookimpl", "load_pipeline", "build_cache", "cache_kwargs", "load_registry"]


def __getattr__(name: str):
    # Lazy, so that `import kvweave.core` (done by every plugin for `hookimpl`) stays cheap.
    if name in ("load_pipeline", "load_registry"):
        from . import registry

        return getattr(registry, name)
    if name in ("build_cache",):
        from . import pipeline

        return getattr(pipeline, name)
    if name == "cache_kwargs":
        from . import generation

        return generation.cache_kwargs
    raise AttributeError(f"module 'kvweave.core' has no attribute {name!r}")
