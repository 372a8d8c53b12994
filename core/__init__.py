"""kvweave's plugin framework: hook specs, plugin host, component interfaces, registry, parameters, errors.

This layer knows nothing of caches or models; the cache engine (:mod:`kvweave.engine`) and the user
tools (:mod:`kvweave.tools`) are built on it. A plugin needs only this package::

    from kvweave.core import hookimpl
    from kvweave.core.interfaces import Router, RouteBlock
"""

from kvweave.core.hookspecs import hookimpl

__all__ = ["hookimpl", "load_pipeline", "load_registry"]


def __getattr__(name: str):
    # Lazy, so that `import kvweave.core` (done by every plugin for `hookimpl`) stays cheap.
    if name in ("load_pipeline", "load_registry"):
        from kvweave.core import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'kvweave.core' has no attribute {name!r}")
