"""``uniform``: every compressed token gets the same residual rank (the paper's "w/o router" row)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.lazy import torch
from kvweave.core.params import integer


@attrs.frozen
class UniformRouter(Router):
    """Rank ``rank`` for every token, layer and head; 0 stores no residual at all."""

    head_sharding: ClassVar[str] = "head-local"

    rank: int = attrs.field(default=0, validator=integer(0, 256), metadata={"doc": "residual channels per token"})

    def check_model(self, shape: ModelShape) -> None:
        if self.rank > shape.head_dim:
            raise ModelError(f"router 'uniform': rank {self.rank} exceeds the model's head_dim {shape.head_dim}")

    def levels(self) -> tuple[int, ...]:
        return (self.rank,)

    def assign(self, block: RouteBlock) -> torch.Tensor:
        return torch.full(block.vectors.shape[:-1], self.rank, dtype=torch.long, device=block.vectors.device)


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("uniform", UniformRouter)
