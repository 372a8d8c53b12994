"""The component groups (one registration hook each) and the pipeline slots that take them."""

from __future__ import annotations

from kvweave.core.evictor import Evictor
from kvweave.core.interfaces import AttentionKernel, BasisBuilder, Component, Probe, Quantizer, Router

GROUP_INTERFACES: dict[str, type[Component]] = {
    "bases": BasisBuilder,
    "routers": Router,
    "quantizers": Quantizer,
    "probes": Probe,
    "kernels": AttentionKernel,
    "evictors": Evictor,
}

#: pipeline slot -> the component group it takes
SLOT_GROUPS: dict[str, str] = {
    "basis": "bases",
    "quantizer": "quantizers",
    "router": "routers",
    "residual_quantizer": "quantizers",
    "probe": "probes",
    "kernel": "kernels",
    "evictor": "evictors",
}

#: slots a pipeline may leave out, with the component they then take
DEFAULT_SLOTS: dict[str, str] = {"evictor": "none"}

#: slots whose component may differ between keys and values: a pipeline's ``keys`` or ``values`` table
#: holds such a slot table (``[pipelines.NAME.keys.quantizer]``), which replaces the shared slot for that
#: kind only (internally the slot ``keys.quantizer``)
KIND_SLOTS: tuple[str, ...] = ("quantizer", "residual_quantizer")
