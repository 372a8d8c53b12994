"""Eviction for :class:`kvweave.engine.engine.CompressionEngine`: routers that give tokens the ``DROPPED``
level (see docs/baselines.md).

Dropped tokens are never stored; kept ones are gathered per batch row and KV head into slots with their
cache index (``-1`` for a filler slot of a row that kept fewer). Attention over such a cache runs through
kvweave's own attention, which turns transformers' mask into one over the slots actually returned
(:meth:`EvictionMixin.physical_mask`); routers that accumulate attention (H2O) get each slot's running
score (:meth:`EvictionMixin._accumulate`). The methods here are the engine's; they live in their own
module because they are one concept of it.
"""

from __future__ import annotations

import torch

from kvweave.core.errors import CacheStateError, ComponentError
from kvweave.core.interfaces import DROPPED, KINDS, RouteBlock


class EvictionMixin:
    """The eviction half of the compression engine (mixed into ``CompressionEngine``)."""

    def _check_eviction(self, where: str) -> None:
        router = f"{where}, slot 'router' ('{self.pipeline.slots['router'].use}')"
        if self.evicts or self.reselects:
            self.router.check_window(self.settings.recent_window, self.settings.block_tokens, router)
        if self.reselects:
            if not self.evicts:
                raise ComponentError(f"{router}: it re-selects stored tokens but never drops any (no DROPPED level)")
            if self.residual_levels or any(len(group) > 1 for group in self.groups):
                raise ComponentError(
                    f"{router}: it re-selects stored tokens, which needs single-layer basis groups and no residual "
                    f"levels (basis '{self.pipeline.slots['basis'].use}', levels {self.levels})"
                )

    # ------------------------------------------------------------------------------- eviction
    def _real_positions(self, logical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For cache indices ``logical`` [B, ...] (-1 = filler): each token's position among its row's real
        tokens (-1 where not valid) and whether it is a real token (not padding, not a filler)."""
        valid = logical >= 0
        if self.padding is None:
            return torch.where(valid, logical, -1), valid
        padding = self.padding.to(logical.device)
        flat = logical.clamp_min(0).reshape(logical.shape[0], -1)
        if flat.numel() and int(flat.max()) >= padding.shape[-1]:
            raise CacheStateError(
                f"the attention mask covers {padding.shape[-1]} tokens, but the cache holds token {int(flat.max())}"
            )
        valid = valid & padding.gather(1, flat).reshape(logical.shape)
        real = (padding.long().cumsum(-1) - 1).gather(1, flat).reshape(logical.shape)
        return torch.where(valid, real, -1), valid

    def _row_tokens(self, batch: int, total: int) -> torch.Tensor:
        if self.padding is None:
            return torch.full((batch,), total, dtype=torch.long)
        return self.padding.long().sum(-1).cpu()

    @staticmethod
    def _kept_index(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``keep`` [..., n] bool -> indices [..., k] (the kept tokens in order, then filler slots up to the
        largest kept count ``k`` of any row) and which of them are kept (False: filler)."""
        n = keep.shape[-1]
        k = int(keep.sum(-1).max()) if keep.numel() else 0
        order = ((~keep).long() * n + torch.arange(n, device=keep.device)).argsort(dim=-1)[..., :k]
        return order, keep.gather(-1, order)

    @staticmethod
    def _gather_tokens(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """``x`` [..., n, D] at token indices ``index`` [..., k] -> [..., k, D]."""
        return x.gather(-2, index.unsqueeze(-1).expand(*index.shape, x.shape[-1]))

    def _check_ranks(self, ranks: torch.Tensor, shape: torch.Size, allow_dropped: bool) -> None:
        allowed = set(self.levels) if allow_dropped else set(self.levels) - {DROPPED}
        stray = set(torch.unique(ranks).tolist()) - allowed
        if stray or ranks.shape != shape:
            raise ComponentError(
                f"router '{self.pipeline.slots['router'].use}' returned ranks {sorted(stray)} / shape "
                f"{tuple(ranks.shape)}; expected values in {sorted(allowed)} shaped {tuple(shape)}"
                + ("" if allow_dropped else " (tokens are already selected: DROPPED is not allowed here)")
            )

    def _eviction_block(
        self, group_index: int, work: torch.Tensor, logical: torch.Tensor, stats, scores, stored: int
    ) -> RouteBlock:
        """The RouteBlock that decides which of ``work`` [G, B, H, n, D] (cache indices ``logical``
        [G, B, H, n]) are dropped."""
        members = self.groups[group_index]
        real, valid = self._real_positions(logical.transpose(0, 1))  # batch first
        mass, spike = stats if stats is not None else (None, None)
        first = self.windows[members[0]]
        return RouteBlock(
            layers=tuple(members),
            kind="keys",
            vectors=work,
            level_bytes=self.budget.level_bytes,
            attention_mass=mass,
            attention_spike=spike,
            boundary=self.observer.boundaries(first.passed_tokens, work.shape[-2] - stored),
            probe_error=self.stores[group_index]["keys"].probe_error,
            valid=valid.transpose(0, 1),
            positions=real.transpose(0, 1),
            scores=scores,
            row_tokens=self._row_tokens(work.shape[1], first.passed_tokens + first.exact_tokens),
            window_tokens=first.exact_tokens - (work.shape[-2] - stored),
            stored=stored,
            held=tuple(0 if stored else self.windows[layer].compressed_tokens for layer in members),
            forward_tokens=self.forward_tokens,
            shared_tokens=len(members) > 1 and self.basis.coefficient_rows(len(members)) == 1,
        )

    def _evict(self, group_index: int, count: int, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Flush ``count`` tokens of a group whose router may drop some: the dropped ones are not stored."""
        members = self.groups[group_index]
        blocks = {kind: torch.stack([self.windows[layer].exact[kind][..., :count, :] for layer in members]) for kind in KINDS}
        work = blocks["keys"].float()
        passed = self.windows[members[0]].passed_tokens
        logical = torch.arange(passed, passed + count, device=work.device).expand(work.shape[:-1])
        scores = None
        if self.accumulates:
            scores = torch.stack([self._score_slice(layer, count)[1] for layer in members])
        route = self._eviction_block(group_index, work, logical, stats, scores, 0)
        ranks = self.router.assign(route)
        self._check_ranks(ranks, work.shape[:-1], allow_dropped=True)
        keep = ranks != DROPPED
        if route.shared_tokens:  # one coefficient row per token for the whole group
            keep = keep.any(0, keepdim=True).expand_as(keep)
        index, kept = self._kept_index(keep)
        slots = index.shape[-1]
        if slots:
            gathered = {kind: self._gather_tokens(blocks[kind], index) for kind in KINDS}
            kept_stats = None if stats is None else tuple(s.gather(-1, index) for s in stats)
            self._flush_info = {"count": count, "dropped": count - slots, "kept_index": index, "blocks": gathered}
            try:
                for kind in KINDS:
                    self._encode(kind, group_index, gathered[kind], kept_stats)  # type: ignore[arg-type]
            finally:
                self._flush_info = None
        positions = torch.where(kept, logical.gather(-1, index), -1).to(torch.int32)
        for member, layer in enumerate(members):
            window = self.windows[layer]
            old = window.positions
            window.positions = positions[member] if old is None else torch.cat((old, positions[member]), dim=-1)
            if self.accumulates:
                stored_scores, block_scores, rest = self._score_slice(layer, count)
                picked = block_scores.gather(-1, index[member]) * kept[member]
                window.scores = torch.cat((stored_scores, picked, rest), dim=-1)
            window.compressed_tokens += slots

    def _score_slice(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The accumulated scores of ``layer`` split into stored slots, the ``count`` tokens now leaving the
        window, and the rest of the window (zeros where no query has attended yet)."""
        window = self.windows[layer]
        exact = window.exact["keys"]
        total = window.compressed_tokens + window.exact_tokens
        scores = window.scores
        if scores is None:
            scores = torch.zeros(*exact.shape[:2], 0, device=exact.device)
        if scores.shape[-1] < total:
            scores = torch.cat((scores, scores.new_zeros(*scores.shape[:2], total - scores.shape[-1])), dim=-1)
        stored = window.compressed_tokens
        return scores[..., :stored], scores[..., stored : stored + count], scores[..., stored + count :]

    def _reselect(self, group_index: int, count: int) -> None:
        """Flush for a router that re-selects among the stored tokens and the ``count`` leaving the window:
        the kept set is re-encoded from the stored values (bit-exact with the `none` quantizer)."""
        (layer,) = self.groups[group_index]
        window = self.windows[layer]
        stored = window.compressed_tokens
        dtype = window.exact["keys"].dtype
        candidates = {}
        for kind in KINDS:
            new = window.exact[kind][..., :count, :]
            candidates[kind] = torch.cat((self.reconstruct(layer, kind, dtype), new), dim=-2) if stored else new
        batch, heads = candidates["keys"].shape[:2]
        fresh = torch.arange(window.passed_tokens, window.passed_tokens + count, device=candidates["keys"].device)
        logical = fresh.expand(batch, heads, count)
        if stored:
            logical = torch.cat((window.positions.long(), logical), dim=-1)
        scores = None
        if self.accumulates:
            stored_scores, block_scores, rest = self._score_slice(layer, count)
            scores = torch.cat((stored_scores, block_scores), dim=-1)
        work = candidates["keys"].float()[None]
        route = self._eviction_block(group_index, work, logical[None], None, None if scores is None else scores[None], stored)
        ranks = self.router.assign(route)
        self._check_ranks(ranks, work.shape[:-1], allow_dropped=True)
        index, kept = self._kept_index(ranks[0] != DROPPED)
        from kvweave.engine.engine import GroupStore  # the engine module imports this one

        self.stores[group_index] = {kind: GroupStore() for kind in KINDS}
        if index.shape[-1]:
            for kind in KINDS:
                self._encode(kind, group_index, self._gather_tokens(candidates[kind], index)[None])
        window.positions = torch.where(kept, logical.gather(-1, index), -1).to(torch.int32)
        if scores is not None:
            window.scores = torch.cat((scores.gather(-1, index) * kept, rest), dim=-1)
        window.compressed_tokens = index.shape[-1]

    def physical_mask(self, layer: int, logical: torch.Tensor | None, queries: int, query_heads: int) -> torch.Tensor | None:
        """The attention mask over what ``update`` returned for ``layer`` (stored slots, then the exact
        window), from the model's mask over logical tokens ``logical`` [B|1, 1, q, T] (bool; None = causal, no
        padding). Unchanged when the layer never dropped a token."""
        window = self.windows[layer]
        if window.positions is None:
            return logical
        exact = window.exact["keys"]
        batch, heads = exact.shape[:2]
        total = window.passed_tokens + window.exact_tokens
        device = exact.device
        if logical is None:
            rows = total - queries + torch.arange(queries, device=device)
            logical = (torch.arange(total, device=device)[None, :] <= rows[:, None])[None, None]
        elif logical.dtype != torch.bool:
            logical = logical == 0  # an additive float mask
        if logical.shape[-1] != total:
            raise CacheStateError(f"layer {layer}: the attention mask covers {logical.shape[-1]} tokens, the cache {total}")
        exact_index = (window.passed_tokens + torch.arange(window.exact_tokens, device=device)).expand(batch, heads, -1)
        index = torch.cat((window.positions.long().clamp_min(0), exact_index), dim=-1)  # [B, H, T_phys]
        source = logical[:, 0].expand(batch, queries, total)[:, None].expand(batch, heads, queries, total)
        mask = source.gather(-1, index[:, :, None, :].expand(batch, heads, queries, index.shape[-1]))
        filler = torch.cat((window.positions >= 0, torch.ones_like(exact_index, dtype=torch.bool)), dim=-1)
        mask = mask & filler[:, :, None, :]
        return mask.repeat_interleave(query_heads // heads, dim=1)

    def prepare_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor | None:
        """Called by the observing attention before ``layer``'s attention: notes the padding (from the model's
        mask), accumulates attention for routers that use it, and returns the mask for the K/V ``update``
        returned (evicted tokens are not there)."""
        if not (self.evicts or self.accumulates):
            return mask
        if mask is not None and mask.dim() == 4:
            allowed = mask if mask.dtype == torch.bool else mask == 0
            self.padding = allowed[:, 0, -1, :].expand(query.shape[0], -1).clone()  # the last query sees every real token
        elif mask is None:
            self.padding = None
        physical = self.physical_mask(layer, mask, query.shape[-2], query.shape[1])
        if self.accumulates:
            self._accumulate(layer, query, key, physical, scaling)
        if physical is not None and query.shape[-2] == 1 and bool(physical.all()):
            return None  # one query that sees every held key: sdpa's fast path, no mask needed
        return physical

    def _accumulate(self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None) -> None:
        """Add the attention probability every query of this forward gives each key (summed over the query
        heads of each KV head) to the layer's accumulated scores."""
        batch, q_heads, queries, dim = query.shape
        heads, total = key.shape[1], key.shape[-2]
        group = q_heads // heads
        scale = scaling or dim**-0.5
        keys = key.float()
        added = torch.zeros(batch, heads, total, device=key.device)
        causal_rows = total - queries + torch.arange(queries, device=key.device)
        for start in range(0, queries, 256):
            stop = min(queries, start + 256)
            q = query[:, :, start:stop].float().reshape(batch, heads, group * (stop - start), dim)
            logits = (q @ keys.transpose(-1, -2) * scale).reshape(batch, heads, group, stop - start, total)
            if mask is None:
                allowed = torch.arange(total, device=key.device)[None, :] <= causal_rows[start:stop, None]
                logits = logits.masked_fill(~allowed, float("-inf"))
            else:
                part = mask[:, :, start:stop].expand(batch, q_heads, stop - start, total)
                logits = logits.masked_fill(~part.reshape(batch, heads, group, stop - start, total), float("-inf"))
            probs = logits.softmax(dim=-1).nan_to_num(0.0)
            if self.padding is not None:  # a padding query gives no attention
                logical = self.seq_length(layer) - queries
                real = self.padding[:, logical + start : logical + stop].to(probs.dtype)
                probs = probs * real[:, None, None, :, None]
            added += probs.sum(dim=(2, 3))
        window = self.windows[layer]
        scores = window.scores
        if scores is None:
            scores = added.new_zeros(batch, heads, 0)
        if scores.shape[-1] < total:
            scores = torch.cat((scores, scores.new_zeros(batch, heads, total - scores.shape[-1])), dim=-1)
        window.scores = scores + added

    def _key_valid(self, layer: int) -> torch.Tensor | None:
        """[B, H, T] whether each key ``update`` returns for ``layer`` is a real token (None: all are)."""
        window = self.windows[layer]
        if window.positions is None and self.padding is None:
            return None
        exact = window.exact["keys"]
        batch, heads = exact.shape[:2]
        device = exact.device
        if window.positions is None:
            stored = torch.arange(window.compressed_tokens, device=device).expand(batch, heads, -1)
        else:
            stored = window.positions.long()
        exact_index = (window.passed_tokens + torch.arange(window.exact_tokens, device=device)).expand(batch, heads, -1)
        return self._real_positions(torch.cat((stored, exact_index), dim=-1))[1]
