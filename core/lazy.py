"""Modules imported when first used: ``torch`` for the component, core and kernel modules, which name it at
module level but use it only inside functions.

Listing a registry's pipelines, the installed plugins or the registered components (``kvweave pipelines``,
``plugins``, ``components``, ``resolve``) imports every component module, and importing torch takes
seconds. Those modules write ``from kvweave.core.lazy import torch`` instead of ``import torch``: the
proxy imports torch the first time one of its attributes is read (a tensor made, ``torch.float16``,
``isinstance(x, torch.Tensor)``), and from then on reads torch's own namespace, so an attribute costs
what it costs on the module. Type checkers see the real module.

What a module evaluates when it is imported must then not read an attribute of ``torch``: a dtype table
is a :class:`DtypeTable` (its names are known without torch), a default argument that is a dtype is
``None``, chosen inside the function.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

__all__ = ["DtypeTable", "LazyModule", "lazy_module", "torch"]


class LazyModule:
    """Stands for the module ``name``, imported the first time one of its attributes is read or set.

    Once imported, the proxy's namespace is the module's own ``__dict__``: attributes are read from it
    directly (``__getattr__`` is then called only for names the module itself computes on demand), and
    what is set on the proxy is set on the module."""

    def __init__(self, name: str) -> None:
        self.__dict__["__name__"] = name  # also the module's own ``__name__`` once the namespaces are one

    def _lazy_load(self) -> Any:
        """The module, imported now if it was not (it then takes over this proxy's namespace)."""
        module = importlib.import_module(self.__dict__["__name__"])
        if self.__dict__ is not module.__dict__:
            object.__setattr__(self, "__dict__", module.__dict__)
        return module

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._lazy_load(), attr)

    def __setattr__(self, attr: str, value: Any) -> None:
        setattr(self._lazy_load(), attr, value)

    def __delattr__(self, attr: str) -> None:
        delattr(self._lazy_load(), attr)

    def __dir__(self) -> list[str]:
        return dir(self._lazy_load())

    def __repr__(self) -> str:
        name = self.__dict__["__name__"]
        module = sys.modules.get(name)
        if module is not None and self.__dict__ is module.__dict__:
            return repr(module)
        return f"<module {name!r}, imported when first used>"


def lazy_module(name: str) -> Any:
    """A :class:`LazyModule` for ``name`` (typed ``Any``: bind the real module under ``TYPE_CHECKING``)."""
    return LazyModule(name)


class DtypeTable(Mapping[str, "torch.dtype"]):
    """torch dtypes by name (``DtypeTable("float16", "float32")["float16"]`` is ``torch.float16``): its
    names are listed and tested without importing torch; looking one up imports it."""

    def __init__(self, *names: str) -> None:
        self._names = names

    def __getitem__(self, name: str) -> torch.dtype:
        if name not in self._names:
            raise KeyError(name)
        return getattr(torch, name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(map(repr, self._names))})"


if TYPE_CHECKING:
    import torch as torch
else:
    torch = LazyModule("torch")
