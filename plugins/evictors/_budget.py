"""Shared parts of the evictors (``streaming-llm``, ``h2o``, ``snapkv``, ``pyramidkv``): token budgets and
the top-k selection over a block's real tokens.

A budget is the number of tokens each KV head of each layer keeps, the exact recent window included:
either ``budget`` (a token count) or ``fraction`` (of the row's real tokens so far). Exactly one is set.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kvweave.core.errors import BudgetError
from kvweave.core.evictor import EvictionBlock
from kvweave.core.lazy import torch


def budget_field() -> Any:
    return attrs.field(
        default=0, validator=_non_negative_int,
        metadata={"doc": "tokens kept per KV head and layer, the exact recent window included (0: use fraction)"},
    )


DEFAULT_FRACTION = 0.125


def fraction_field() -> Any:
    return attrs.field(
        default=None, validator=_unit_fraction,
        metadata={"doc": f"share of the row's real tokens kept per KV head and layer, window included (default {DEFAULT_FRACTION} unless budget is set)"},
    )


def _non_negative_int(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"'{attribute.alias}' must be a non-negative integer, got {value!r}")


def _unit_fraction(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"'{attribute.alias}' must be a number in (0, 1], got {value!r}")


def check_one_budget(instance: Any, name: str) -> None:
    """At most one of ``budget`` and ``fraction`` may be set (neither: ``fraction`` = DEFAULT_FRACTION)."""
    if instance.budget > 0 and instance.fraction is not None:
        raise ValueError(
            f"evictor '{name}': set either 'budget' (tokens, got {instance.budget}) or 'fraction' (of the tokens, "
            f"got {instance.fraction}), not both"
        )


def check_budget_holds_window(budget: int, recent_window: int, block_tokens: int, where: str, parameter: str = "budget") -> None:
    """A token budget must hold at least the exact recent window (which is never evicted)."""
    if budget and budget < recent_window:
        raise BudgetError(
            f"{where}: '{parameter}' = {budget} tokens cannot hold the pipeline's exact recent window "
            f"(recent_window = {recent_window}, never evicted); raise '{parameter}' to at least {recent_window} or "
            "lower recent_window"
        )


def totals(block: EvictionBlock, budget: int, fraction: float | None) -> torch.Tensor:
    """Tokens each batch row keeps in total [B] (window included)."""
    rows = block.row_tokens
    if budget:
        return torch.full_like(rows, budget)
    return torch.ceil(rows.double() * (DEFAULT_FRACTION if fraction is None else fraction)).long()


def keep_top(scores: torch.Tensor, valid: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Keep [G, B, H, n]: True for the ``counts[b]`` highest-scoring valid tokens of each (layer, row, head)
    (``counts`` [B] or [G, B])."""
    groups, batch = scores.shape[:2]
    n = scores.shape[-1]
    counts = counts.to(scores.device)
    if counts.dim() == 1:
        counts = counts.expand(groups, batch)
    masked = scores.float().masked_fill(~valid, float("-inf"))
    order = masked.argsort(dim=-1, descending=True, stable=True)
    rank_of = torch.empty_like(order)
    rank_of.scatter_(-1, order, torch.arange(n, device=scores.device).expand_as(order))
    return (rank_of < counts.clamp(0, n)[:, :, None, None]) & valid


def pool(votes: torch.Tensor, kernel: int, mode: str) -> torch.Tensor:
    """1D pooling of ``votes`` [..., n] along the tokens (stride 1, same length; zeros beyond the ends)."""
    flat = votes.reshape(-1, 1, votes.shape[-1]).float()
    if kernel > 1:
        if mode == "max":
            flat = torch.nn.functional.max_pool1d(flat, kernel, stride=1, padding=kernel // 2)
        else:
            flat = torch.nn.functional.avg_pool1d(flat, kernel, stride=1, padding=kernel // 2, count_include_pad=True)
    return flat.reshape(votes.shape)


def ceil_int(x: float) -> int:
    return int(math.ceil(x))
