"""``none``: no online probe; the router's decisions are never revised."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import Probe


@attrs.frozen
class NoProbe(Probe):
    """Observes nothing."""

    head_sharding: ClassVar[str] = "head-local"


@hookimpl
def kvweave_register_probes(registrar) -> None:
    registrar.add("none", NoProbe)
