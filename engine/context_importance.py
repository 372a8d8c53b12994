"""The context importance an evictor with ``needs_importance`` chooses by (``kvzip``): scores [L, B, H, T] of the
tokens the cache's first forward feeds, computed before it by :mod:`kvweave.engine.importance` and handed to
the cache (``KVWeaveCache.set_importance``). They are prepared once by the evictor
(``Evictor.prepare_importance``), serve the flushes of that one forward, and are dropped after it; tokens fed
later are kept whatever their score.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.core.errors import CacheStateError, ComponentError

if TYPE_CHECKING:
    from kvweave.engine.eviction import Eviction


class ContextImportance:
    """The scores an :class:`~kvweave.engine.eviction.Eviction` holds for the forward that fills its cache."""

    def __init__(self, eviction: Eviction) -> None:
        self.eviction = eviction
        #: [L, B, H, T] as the evictor prepared them, held for the next forward only (None: none held)
        self.scores: torch.Tensor | None = None
        self.scored_tokens = 0  # tokens the cache's first forward had scored (0: never scored)
        self._used = False

    def clear(self) -> None:
        self.scores, self.scored_tokens, self._used = None, 0, False

    def set(self, scores: torch.Tensor) -> None:
        """Hold ``scores`` [L, B, H, T] (float, ``+inf`` = never evicted by score) for the next forward,
        which must feed exactly those ``T`` tokens into the empty cache."""
        engine = self.eviction.engine
        name = engine.pipeline.name
        if not (engine.evicts and self.eviction.evictor.needs_importance):
            raise CacheStateError(
                f"pipeline '{name}': its evictor ('{engine.pipeline.use('evictor')}') does not choose tokens by context importance")
        if engine.seq_length(0) != 0:
            raise CacheStateError(f"pipeline '{name}': context importance is set before the first forward, but the cache holds {engine.seq_length(0)} tokens")
        shape = engine.shape
        if scores.dim() != 4 or scores.shape[0] != shape.num_layers or scores.shape[2] != shape.num_kv_heads or scores.shape[-1] < 1:
            raise CacheStateError(
                f"pipeline '{name}': context importance shaped {tuple(scores.shape)}; expected [layers {shape.num_layers}, batch, "
                f"KV heads {shape.num_kv_heads}, tokens]")
        if torch.isnan(scores).any():
            raise CacheStateError(f"pipeline '{name}': context importance holds NaN")
        prepared = self.eviction.evictor.prepare_importance(scores.float())
        if prepared.shape != scores.shape or torch.isnan(prepared).any() or not bool(torch.isinf(prepared[torch.isinf(scores)]).all()):
            raise ComponentError(
                f"pipeline '{name}', slot 'evictor' ('{engine.pipeline.use('evictor')}'): prepare_importance must return the scores' "
                f"shape {tuple(scores.shape)} without NaN, keeping +inf where the scorer put it")
        self.scores = prepared
        self.scored_tokens = int(scores.shape[-1])
        self._used = False

    def start_forward(self, tokens: int, batch: int) -> None:
        """Layer 0 of a forward of ``tokens`` tokens: the held importance is for the first forward only."""
        if self.scores is None:
            return
        if self._used:
            self.scores = None
            return
        self._used = True
        expected = tuple(self.scores.shape[i] for i in (1, 3))
        if (batch, tokens) != expected or self.eviction.engine.seq_length(0) != 0:
            self.scores = None
            raise CacheStateError(
                f"pipeline '{self.eviction.engine.pipeline.name}': the context importance scored {expected[1]} tokens of {expected[0]} rows, "
                f"but the first forward feeds {tokens} tokens of {batch} rows into a cache holding {self.eviction.engine.seq_length(0)}"
            )

    def at(self, members: tuple[int, ...], logical: torch.Tensor) -> torch.Tensor | None:
        """Each token's importance [G, B, H, n] at cache indices ``logical`` (``+inf`` where unscored), or
        None when the cache was never scored."""
        if not self.scored_tokens:
            return None
        out = torch.full(logical.shape, float("inf"), device=logical.device)
        if self.scores is None:
            return out
        scores = self.scores[list(members)].to(logical.device)  # [G, B, H, T]
        total = scores.shape[-1]
        scored = (logical >= 0) & (logical < total)
        picked = scores.expand(*logical.shape[:-1], total).gather(-1, logical.clamp(0, total - 1).long())
        return torch.where(scored, picked, out)
