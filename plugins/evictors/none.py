"""``none``: every token leaving the exact window is stored (the default ``evictor`` slot)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.lazy import torch


@attrs.frozen
class KeepAll(Evictor):
    """Never drops a token; the engine does not call it."""

    head_sharding: ClassVar[str] = "head-local"

    evicts: ClassVar[bool] = False

    def keep(self, block: EvictionBlock) -> torch.Tensor:
        return block.valid.clone()


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("none", KeepAll)
