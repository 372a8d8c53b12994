"""``norm-tiers``: residual ranks by key/value norm, in three tiers per block, batch row and head.

For a block ``x`` [G, B, H, n, D], each token's L2 norm over ``D`` is ranked within its (layer, b, h) row:
the ``round(high_fraction * n)`` largest get ``high_rank`` residual channels, the next
``round((high_fraction + low_fraction) * n) - round(high_fraction * n)`` get ``low_rank``, the rest 0.
"""

from __future__ import annotations

import math

import attrs
import torch

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.params import integer, number


def _count(fraction: float, tokens: int) -> int:
    """``fraction * tokens`` rounded half up (not Python's round-half-even)."""
    return min(tokens, math.floor(fraction * tokens + 0.5))


@attrs.frozen
class NormTiersRouter(Router):
    """high_rank for the largest-norm tokens of a block, low_rank for the next tier, 0 for the rest."""

    high_rank: int = attrs.field(default=8, validator=integer(1, 256), metadata={"doc": "residual channels of the top tier"})
    low_rank: int = attrs.field(default=2, validator=integer(0, 256), metadata={"doc": "residual channels of the middle tier"})
    high_fraction: float = attrs.field(
        default=0.05, validator=number(0.0, 1.0), metadata={"doc": "share of tokens per block, batch row and head in the top tier"}
    )
    low_fraction: float = attrs.field(
        default=0.20, validator=number(0.0, 1.0), metadata={"doc": "share of tokens per block, batch row and head in the middle tier"}
    )

    def __attrs_post_init__(self) -> None:
        if self.low_rank >= self.high_rank:
            raise ValueError(f"'low_rank' ({self.low_rank}) must be smaller than 'high_rank' ({self.high_rank})")
        if self.high_fraction + self.low_fraction > 1:
            raise ValueError(
                f"'high_fraction' + 'low_fraction' must be <= 1, got {self.high_fraction} + {self.low_fraction}"
            )

    def check_model(self, shape: ModelShape) -> None:
        if self.high_rank > shape.head_dim:
            raise ModelError(
                f"router 'norm-tiers': high_rank {self.high_rank} exceeds the model's head_dim {shape.head_dim}"
            )

    def levels(self) -> tuple[int, ...]:
        return tuple(sorted({0, self.low_rank, self.high_rank}))

    def assign(self, block: RouteBlock) -> torch.Tensor:
        """``block.vectors`` [G, B, H, n, D] -> ranks, a long tensor [G, B, H, n] of values in ``levels()``."""
        x = block.vectors
        tokens = x.shape[-2]
        n_high = _count(self.high_fraction, tokens)
        n_tiered = _count(self.high_fraction + self.low_fraction, tokens)
        order = x.float().norm(dim=-1).argsort(dim=-1, descending=True)  # [B, H, n], largest norm first
        place = torch.empty_like(order)
        place.scatter_(-1, order, torch.arange(tokens, device=x.device).expand_as(order))  # each token's place
        ranks = torch.zeros_like(order)
        ranks[place < n_tiered] = self.low_rank
        ranks[place < n_high] = self.high_rank
        return ranks


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("norm-tiers", NormTiersRouter)
