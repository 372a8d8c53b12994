"""``h2o``: heavy hitters by accumulated attention plus the recent window, under a fixed budget.

Zhang, Sheng, Zhou, Chen, Zheng, Cai, Song, Tian, Ré, Barrett, Wang, Chen: "H2O: Heavy-Hitter Oracle for
Efficient Generative Inference of Large Language Models" (NeurIPS 2023, arXiv:2306.14048). The cache
accumulates, for every held token, the attention probability every query has given it (all prompt
queries, then each generated one; summed over the query heads of each KV head). At every flush the
stored tokens and those leaving the exact recent window compete: each KV head of each layer keeps the
``budget - window`` with the most accumulated attention (a token evicted once never returns). The
recent window is the pipeline's exact window.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.lazy import torch

from ._budget import budget_field, check_budget_holds_window, check_one_budget, fraction_field, keep_top, totals


@attrs.frozen
class H2OEvictor(Evictor):
    """Keep the heavy hitters (most accumulated attention) and the recent window."""

    head_sharding: ClassVar[str] = "head-local"

    budget: int = budget_field()
    fraction: float | None = fraction_field()

    accumulates = True
    reselects = True

    def __attrs_post_init__(self) -> None:
        check_one_budget(self, "h2o")

    def check_window(self, recent_window: int, block_tokens: int, where: str) -> None:
        check_budget_holds_window(self.budget, recent_window, block_tokens, where)

    def keep(self, block: EvictionBlock) -> torch.Tensor:
        if block.scores is None:
            raise ValueError("evictor 'h2o' needs accumulated attention scores (build the cache with build_cache)")
        counts = totals(block, self.budget, self.fraction) - block.window_tokens
        return keep_top(block.scores, block.valid, counts)


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("h2o", H2OEvictor)
