"""``salience``: token-adaptive precision from query-agnostic signals.

DepthWeave-KV's multi-level routing (arXiv:2607.06523, Section 3) gives each token a residual rank; here
the levels are read as precision tiers. A token at rank ``rho = head_dim`` (``residual_mode =
"channels"``) stores the whole error its packed codes left, quantized by the pipeline's
``residual_quantizer``: a 3-bit key with a 2-bit residual of its error is a ~5-bit key, paid for by that
token alone. Which tokens get the tier is decided without the question, from what the cache sees while
the context is compressed:

- ``sink``: the first ``sink_tokens`` positions of the sequence (attention sinks, Xiao et al. 2023,
  arXiv:2309.17453) always rank first;
- ``attention``: the attention mass and the largest probability the recent queries of the context give
  the token (the tokens the context itself keeps reading, as in H2O / SnapKV, arXiv:2306.14048,
  arXiv:2404.14469), needing the cache to observe queries;
- ``outlier``: the token's largest per-channel z-score within the block (rare tokens such as numbers
  and names have keys far from the block's distribution; KVQuant, arXiv:2401.18079, keeps such values
  exactly);
- ``miss``: the relative error its packed codes leave, ``||x - x_hat|| / ||x||`` (what the tier repairs).

Each signal is turned into its rank within the token's (layer, batch row, KV head) block, in ``[0, 1]``,
so that signals of different scales add; the score is their weighted sum. The tokens with the highest
scores take the levels, highest level first, in the proportions ``shares`` (the share of each block's
tokens at each level > 0). With a ``target_reduction`` the pipeline's stored bytes are held to ``16-bit
bytes / target``: the shares then only set the proportions between levels, and as many tokens get a tier
as the block's residual budget pays for (the budget in docs/depthweave.md). ``kinds`` chooses whether
keys, values or both get tiers.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs
from kvweave.core.lazy import torch

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.params import choice, int_tuple, integer, number

SIGNALS = ("attention", "outlier", "miss")


def _levels(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or len(value) < 2 or value[0] != 0 or list(value) != sorted(set(value)):
        raise ValueError(f"'levels' must start at 0 and rise strictly, with at least one level above 0; got {list(value)}")


def _shares(value: Any) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"'shares' must be a list of numbers (one per level above 0), got {value!r}")
    return tuple(float(v) for v in value)


def _share_values(instance: Any, attribute: attrs.Attribute, value: tuple[float, ...]) -> None:
    if any(not math.isfinite(v) or v < 0 for v in value) or not 0 < sum(value) <= 1:
        raise ValueError(f"'shares' must be finite, >= 0 and sum to more than 0 and at most 1; got {list(value)}")


def block_rank(x: torch.Tensor) -> torch.Tensor:
    """Each entry's rank along the last axis scaled to [0, 1] (ties by order; one token: 1)."""
    n = x.shape[-1]
    order = x.argsort(dim=-1)
    ranks = torch.empty_like(x)
    ranks.scatter_(-1, order, torch.arange(n, device=x.device, dtype=x.dtype).expand_as(x))
    return ranks / max(n - 1, 1) if n > 1 else torch.ones_like(x)


def outlier_score(vectors: torch.Tensor) -> torch.Tensor:
    """Each token's largest |z| over channels, against the mean and spread of its block [..., n, D] -> [..., n]."""
    mean = vectors.mean(dim=-2, keepdim=True)
    spread = vectors.std(dim=-2, keepdim=True, correction=0).clamp_min(1e-6) if vectors.shape[-2] > 1 else torch.ones_like(mean)
    return ((vectors - mean) / spread).abs().amax(dim=-1)


@attrs.frozen
class SalienceRouter(Router):
    """Precision tiers (residual levels) for the most salient tokens of each block."""

    #: one byte budget for keys and values together (tiers usually go to keys only; engine/budget.py)
    pools_budget: ClassVar[bool] = True
    #: under tensor parallelism each rank tiers its own heads' tokens within its share of the budget
    head_sharding: ClassVar[str] = "rank-budget"

    levels_: tuple[int, ...] = attrs.field(
        default=(0, 64), converter=int_tuple, validator=_levels, alias="levels",
        metadata={"doc": "residual ranks, ascending from 0; rank = head_dim stores a token's whole error (a precision tier)"},
    )
    shares: tuple[float, ...] = attrs.field(
        default=(0.1,), converter=_shares, validator=_share_values,
        metadata={"doc": "share of each block's tokens at each level above 0 (with target_reduction: their proportions)"},
    )
    target_reduction_: float = attrs.field(
        default=0.0, validator=number(0.0, 1000.0), alias="target_reduction",
        metadata={"doc": "0: tiers by shares only; else stored bytes held to 16-bit bytes / this, tiers filling what is left"},
    )
    kinds: str = attrs.field(
        default="keys", validator=choice(("keys", "values", "both")), metadata={"doc": "which of keys and values get tiers"},
    )
    sink_tokens: int = attrs.field(default=4, validator=integer(0, 1 << 20), metadata={"doc": "first positions of the sequence always ranked first"})
    attention: float = attrs.field(default=1.0, validator=number(0.0, 100.0), metadata={"doc": "weight of the attention the context's recent queries give the token"})
    outlier: float = attrs.field(default=1.0, validator=number(0.0, 100.0), metadata={"doc": "weight of the token's largest per-channel z-score in its block"})
    miss: float = attrs.field(default=1.0, validator=number(0.0, 100.0), metadata={"doc": "weight of the relative error the packed codes leave"})

    def __attrs_post_init__(self) -> None:
        if len(self.shares) != len(self.levels_) - 1:
            raise ValueError(f"'shares' needs one value per level above 0 ({len(self.levels_) - 1} for levels {list(self.levels_)}), got {list(self.shares)}")
        if self.target_reduction_ and self.target_reduction_ <= 1.0:
            raise ValueError(f"'target_reduction' must be 0 (no budget) or above 1, got {self.target_reduction_}")

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return self.attention > 0

    def check_model(self, shape: ModelShape) -> None:
        if self.levels_[-1] > shape.head_dim:
            raise ModelError(f"router 'salience': level {self.levels_[-1]} exceeds the model's head_dim {shape.head_dim}")

    def levels(self) -> tuple[int, ...]:
        return self.levels_

    def target_reduction(self) -> float | None:
        return self.target_reduction_ or None

    def scores(self, block: RouteBlock) -> torch.Tensor:
        """Salience [G, B, H, n]: the weighted sum of the signals' block ranks; sinks above every other token."""
        vectors = block.vectors
        score = torch.zeros(vectors.shape[:-1], device=vectors.device)
        if self.attention and block.attention_mass is not None:
            score += self.attention * 0.5 * (block_rank(block.attention_mass.float()) + block_rank(block.attention_spike.float()))
        if self.outlier:
            score += self.outlier * block_rank(outlier_score(vectors.float()))
        if self.miss and block.miss is not None:
            score += self.miss * block_rank(block.miss.float())
        if self.sink_tokens and block.first < self.sink_tokens:
            sinks = min(self.sink_tokens - block.first, vectors.shape[-2])
            score[..., :sinks] += 1.0 + self.attention + self.outlier + self.miss
        return score

    def counts(self, block: RouteBlock) -> list[int]:
        """Tokens per (layer, row, head) of the block at each level above 0, highest level last."""
        n = block.vectors.shape[-2]
        wanted = [int(round(share * n)) for share in self.shares]
        if block.budget_bytes is None:
            return wanted
        heads = math.prod(block.vectors.shape[:-2])
        per_share = sum(block.level_bytes[rank] * share for rank, share in zip(self.levels_[1:], self.shares))
        scale = block.budget_bytes / (heads * n * per_share) if per_share else 0.0  # how many "share units" the budget pays
        counts = [int(math.floor(share * n * min(scale, 1 / sum(self.shares)))) for share in self.shares]
        return counts

    def assign(self, block: RouteBlock) -> torch.Tensor:
        shape = block.vectors.shape[:-1]
        ranks = torch.zeros(shape, dtype=torch.long, device=block.vectors.device)
        if self.kinds != "both" and block.kind != self.kinds:
            return ranks
        counts = self.counts(block)
        if not sum(counts):
            return ranks
        order = self.scores(block).argsort(dim=-1, descending=True)
        start = 0
        for rank, count in reversed(list(zip(self.levels_[1:], counts))):  # highest level to the best scores
            if count:
                chosen = order[..., start:start + count]
                ranks.scatter_(-1, chosen, rank)
                start += count
        return ranks


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("salience", SalienceRouter)
