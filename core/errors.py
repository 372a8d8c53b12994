"""The errors kvweave raises. Each message says what was wrong, where, and what is accepted."""

from __future__ import annotations


class KvweaveError(Exception):
    """Base class of every error kvweave raises on purpose."""


class PluginError(KvweaveError):
    """A plugin could not be loaded, or two plugins registered the same component name."""


class RegistryError(KvweaveError):
    """A registry file is malformed, or a pipeline in it cannot be resolved."""


class ComponentError(KvweaveError):
    """A component name is unknown, or its parameters are wrong."""


class ModelError(KvweaveError):
    """A model cannot be found or loaded, or a pipeline cannot handle it."""


class BudgetError(KvweaveError):
    """A memory budget cannot be met with the components a pipeline was given."""


class CacheStateError(KvweaveError):
    """An operation the compressed cache cannot perform in its current state."""
