"""The hooks a kvweave plugin may implement: one collect-all registration hook per component group.

A plugin is a module (or object) with functions marked ``@kvweave.core.hookimpl``; it is found
through the ``kvweave`` entry-point group, exactly like the built-in components. Each hook receives
a :class:`~kvweave.core.plugins.Registrar` and calls ``registrar.add(name, factory)`` once per
component it provides. Every plugin's implementation is called (no hook stops at the first answer).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvweave.core.plugins import Registrar

PROJECT_NAME = "kvweave"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kvweave_register_bases(registrar: Registrar) -> None:
    """Register basis builders: how a key/value vector [D] becomes coefficients [r] and back."""


@hookspec
def kvweave_register_routers(registrar: Registrar) -> None:
    """Register routers: which residual rank level each token gets."""


@hookspec
def kvweave_register_quantizers(registrar: Registrar) -> None:
    """Register quantizers: how coefficients and residuals are packed into bytes."""


@hookspec
def kvweave_register_probes(registrar: Registrar) -> None:
    """Register probes: online checks of the attention output that steer the router."""


@hookspec
def kvweave_register_kernels(registrar: Registrar) -> None:
    """Register attention kernels: how attention reads the stored cache."""


@hookspec
def kvweave_register_evictors(registrar: Registrar) -> None:
    """Register evictors: which tokens leaving the exact window are stored at all."""
