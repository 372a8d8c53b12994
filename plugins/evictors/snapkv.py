"""``snapkv``: observation-window voting with 1D pooling, the top tokens kept per KV head, at prefill.

Li, Huang, Yang, Venkitesh, Locatelli, Ye, Cai, Lewis, Chen: "SnapKV: LLM Knows What You are Looking for
Before Generation" (NeurIPS 2024, arXiv:2404.14469). The last queries of the prompt (the observation
window: the pipeline's ``observe_queries``) vote for prompt tokens with their attention probabilities,
summed over the window and over the query heads of each KV head; the votes are pooled along the tokens
(``kernel``, ``pooling``) so that neighbours of a selected token come with it; each KV head of each layer
keeps its top tokens up to the budget; the recent window (the pipeline's exact window, which contains
the observation window) is always kept. Selection happens when a forward of several tokens (the
prompt, or each chunk of a prompt fed in chunks, the budget then shared by the chunks in order) flushes;
tokens generated one at a time are kept, as in the paper. Padding never receives votes or slots.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

from ._budget import budget_field, check_budget_holds_window, check_one_budget, fraction_field, keep_top, pool, totals


def _odd(_instance, attribute, value) -> None:
    if value % 2 == 0:
        raise ValueError(f"'{attribute.name}' must be odd (the pooled votes keep the token count), got {value}")


@attrs.frozen
class SnapKVEvictor(Evictor):
    """Top tokens per KV head by pooled observation-window votes, selected once at prefill."""

    head_sharding: ClassVar[str] = "head-local"

    budget: int = budget_field()
    fraction: float | None = fraction_field()
    kernel: int = attrs.field(default=7, validator=[integer(1, 257), _odd], metadata={"doc": "pooling kernel size (odd; 1 = no pooling)"})
    pooling: str = attrs.field(default="avg", validator=choice(("avg", "max")), metadata={"doc": "1D pooling of the votes"})

    needs_attention = True

    def __attrs_post_init__(self) -> None:
        check_one_budget(self, self.name())

    def name(self) -> str:
        return "snapkv"

    def check_window(self, recent_window: int, block_tokens: int, where: str) -> None:
        check_budget_holds_window(self.budget, recent_window, block_tokens, where)

    def layer_totals(self, block: EvictionBlock) -> torch.Tensor:
        """Tokens kept in total [G, B] by each layer of the block and each row (window included)."""
        return totals(block, self.budget, self.fraction).expand(len(block.layers), -1)

    def keep(self, block: EvictionBlock) -> torch.Tensor:
        shape = block.keys.shape[:-1]
        if block.forward_tokens <= 1:
            return torch.ones(shape, dtype=torch.bool, device=block.keys.device)  # decoding: kept
        if block.attention_mass is None:
            raise ValueError(f"evictor '{self.name()}' needs the observed queries' attention (build the cache with build_cache)")
        votes = pool(block.attention_mass.masked_fill(~block.valid, 0.0), self.kernel, self.pooling)
        held = torch.tensor(block.held or (0,) * len(block.layers), dtype=torch.long)[:, None]
        counts = self.layer_totals(block) - block.window_tokens - held  # earlier chunks' slots count
        if block.shared_tokens:  # one coefficient row per token for the group: one selection for all its layers
            votes = votes.sum(dim=0, keepdim=True).expand(shape)
            counts = counts.max(dim=0, keepdim=True).values.expand_as(counts)
        return keep_top(votes, block.valid, counts)


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("snapkv", SnapKVEvictor)
