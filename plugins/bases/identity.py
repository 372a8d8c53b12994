"""``identity``: no basis; the coefficients are the key/value vectors themselves (r = D).

Used by the pipelines that only quantize (``full``, ``int8``, ``int4``). Nothing is shared across
layers, so each layer is its own group.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch


@attrs.frozen
class IdentityBasis(BasisBuilder):
    """Coefficients [1, B, H, n, D] equal to the input vectors; no stored state."""

    head_sharding: ClassVar[str] = "head-local"
    keeps_channels: ClassVar[bool] = True
    identity: ClassVar[bool] = True

    def coefficient_width(self, shape: ModelShape) -> int:
        return shape.head_dim

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return x

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        return coefficients[member]


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("identity", IdentityBasis)
