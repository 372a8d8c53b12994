"""``reference``: the cache reconstructs K/V in ``update()`` and the model's own attention reads them.

This is the path every fused kernel is tested against. It materializes the full K/V of one layer at a
time (transient memory, freed after the layer's attention); the stored cache stays packed.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import AttentionKernel


@attrs.frozen
class ReferenceKernel(AttentionKernel):
    """Reconstruct, then run the model's configured attention (sdpa or eager)."""

    head_sharding: ClassVar[str] = "head-local"


@hookimpl
def kvweave_register_kernels(registrar) -> None:
    registrar.add("reference", ReferenceKernel)
