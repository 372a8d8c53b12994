"""``sinks``: the first positions of the sequence stored (near) exactly, every other token left to its codes.

The first tokens of a sequence draw a large share of every later query's attention (attention sinks, Xiao et
al. 2023, arXiv:2309.17453: on SmolLM2-135M-Instruct token 0 takes about a quarter of the attention of the
last 128 positions of a 1,024-token essay), so the error of their codes moves every later output. KVQuant
(Hooper et al. 2024, arXiv:2401.18079) and IntactKV (Liu et al. 2024, arXiv:2403.01241) keep them in 16 bits.
This router gives the first ``sink_tokens`` positions residual rank ``rank`` (with ``residual_mode =
"channels"`` and ``rank = head_dim`` the whole error their codes leave, stored by the pipeline's
``residual_quantizer``: ``none`` at float16 restores them to float16 precision) and rank 0, which costs
nothing, to every other token. Their bytes are counted with the residuals.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer


@attrs.frozen
class SinkRouter(Router):
    """Rank ``rank`` for the first ``sink_tokens`` positions of each sequence, 0 for every other token."""

    head_sharding: ClassVar[str] = "head-local"

    sink_tokens: int = attrs.field(default=4, validator=integer(1, 1 << 16), metadata={"doc": "first positions of the sequence given the residual"})
    rank: int = attrs.field(default=64, validator=integer(1, 256), metadata={"doc": "their residual rank (head_dim: the whole error)"})
    kinds: str = attrs.field(default="both", validator=choice(("keys", "values", "both")), metadata={"doc": "which of keys and values get it"})

    def check_model(self, shape: ModelShape) -> None:
        if self.rank > shape.head_dim:
            raise ModelError(f"router 'sinks': rank {self.rank} exceeds the model's head_dim {shape.head_dim}; set rank = {shape.head_dim}")

    def levels(self) -> tuple[int, ...]:
        return (0, self.rank)

    def routed_tokens(self, kind: str, first: int) -> int:
        """The sinks among the block's tokens: none past the first ``sink_tokens`` positions (every decode-time
        block) or for the kind not chosen."""
        return max(0, self.sink_tokens - first) if self.kinds in ("both", kind) else 0

    def fixed_ranks(self, kind: str, first: int, tokens: int) -> tuple[tuple[int, int, int], ...]:
        """``rank`` for the block's tokens among the first ``sink_tokens`` positions (one run), 0 for the others (what
        :meth:`assign` gives every row and head)."""
        sinks = min(self.routed_tokens(kind, first), tokens)
        return ((0, sinks, self.rank),) if sinks else ()

    def assign(self, block: RouteBlock) -> torch.Tensor:
        ranks = torch.zeros(block.vectors.shape[:-1], dtype=torch.long, device=block.vectors.device)
        if (self.kinds == "both" or block.kind == self.kinds) and block.first < self.sink_tokens:
            ranks[..., : self.sink_tokens - block.first] = self.rank
        return ranks


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("sinks", SinkRouter)
