"""Eviction for :class:`kvweave.engine.engine.CompressionEngine`: pipelines whose ``evictor`` slot drops tokens (see
docs/baselines.md).

Dropped tokens are never stored; kept ones are gathered per batch row and KV head into slots with their cache index
(``-1`` for a filler slot of a row that kept fewer). Attention over such a cache runs through kvweave's own attention,
which turns transformers' mask into one over the slots actually returned (:meth:`Eviction.physical_mask`); routers that
accumulate attention (H2O) get each slot's running score (:meth:`Eviction._accumulate`). The methods here are the
engine's; they live in their own module because they are one concept of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from kvweave.core.deferred import check
from kvweave.core.errors import CacheStateError, ComponentError
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.interfaces import KINDS, RouteBlock, Router
from kvweave.core.storage import stack_layers
from kvweave.engine.context_importance import ContextImportance
from kvweave.engine.store import GroupStore

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine

#: RouteBlock fields with a token axis [G, B, H, n, ...], split per part by :meth:`Eviction.rank_kept`
TOKEN_FIELDS = ("vectors", "attention_mass", "attention_spike", "miss", "approx", "rows")



class Eviction:
    """The engine's collaborator for a pipeline whose evictor drops tokens: builds the evictor's
    :class:`EvictionBlock`, stores the kept tokens through the engine's encoder, keeps every slot's
    logical position, and turns the model's mask into one over the slots actually stored."""

    def __init__(self, engine: CompressionEngine, evictor: Evictor) -> None:
        self.engine = engine
        self.evictor = evictor
        #: the context importance of the forward that fills the cache, for an evictor with ``needs_importance``
        self.context = ContextImportance(self)

    def check(self, where: str) -> None:
        """Refuse what the evictor cannot work with (a token budget below the window, re-selection with
        shared layers or residual ranks)."""
        engine = self.engine
        slot = f"{where}, slot 'evictor' ('{engine.pipeline.use('evictor')}')"
        self.evictor.check_window(engine.settings.recent_window, engine.settings.block_tokens, slot)
        if self.evictor.reselects and engine.pre_rope:
            raise ComponentError(
                f"{slot}: it re-selects stored tokens and re-encodes them bit-exactly, which keys stored before the "
                "rotary embedding cannot promise (setting key_space = 'pre-rope'); use key_space 'post-rope'"
            )
        if self.evictor.reselects and (engine.residual_levels or any(len(group) > 1 for group in engine.groups)):
            raise ComponentError(
                f"{slot}: it re-selects stored tokens, which needs single-layer basis groups (slot 'basis': "
                f"'{engine.pipeline.use('basis')}') and no residual levels (slot 'router': levels {engine.levels})"
            )

    # ------------------------------------------------------------------------------- eviction
    def _real_positions(self, logical: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """For cache indices ``logical`` [B, ...] (-1 = filler): each token's position among its row's real
        tokens (-1 where not valid) and whether it is a real token (not padding, not a filler)."""
        valid = logical >= 0
        if self.engine.padding is None:
            return torch.where(valid, logical, -1), valid
        padding = self.engine.padding.to(logical.device)
        flat = logical.clamp_min(0).reshape(logical.shape[0], -1)
        if flat.numel() and int(flat.max()) >= padding.shape[-1]:
            raise CacheStateError(
                f"the attention mask covers {padding.shape[-1]} tokens, but the cache holds token {int(flat.max())}"
            )
        valid = valid & padding.gather(1, flat).reshape(logical.shape)
        real = (padding.long().cumsum(-1) - 1).gather(1, flat).reshape(logical.shape)
        return torch.where(valid, real, -1), valid

    def _row_tokens(self, batch: int, total: int) -> torch.Tensor:
        if self.engine.padding is None:
            return torch.full((batch,), total, dtype=torch.long)
        return self.engine.padding.long().sum(-1).cpu()

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

    def _check_keep(self, keep: torch.Tensor, shape: torch.Size) -> None:
        if keep.dtype != torch.bool or keep.shape != shape:
            raise ComponentError(
                f"evictor '{self.engine.pipeline.use('evictor')}' returned {keep.dtype} shaped {tuple(keep.shape)}; "
                f"expected torch.bool shaped {tuple(shape)}"
            )

    def _eviction_block(
        self, group_index: int, work: torch.Tensor, logical: torch.Tensor, stats, scores, stored: int,
        members: tuple[int, ...] | None = None, like: int | None = None,
    ) -> EvictionBlock:
        """The block that decides which of ``work`` [G, B, H, n, D] (cache indices ``logical`` [G, B, H, n]) are dropped;
        ``members``: its layers if not one group's; ``like``: a layer holding what theirs will (else the first member)."""
        members = self.engine.groups[group_index] if members is None else members
        real, valid = self._real_positions(logical.transpose(0, 1))  # batch first
        mass, spike = stats if stats is not None else (None, None)
        first = self.engine.windows[members[0] if like is None else like]
        return EvictionBlock(
            layers=tuple(members), keys=work, attention_mass=mass, attention_spike=spike,
            boundary=self.engine.observer.boundaries(first.passed_tokens, work.shape[-2] - stored, work.device),
            valid=valid.transpose(0, 1), positions=real.transpose(0, 1), scores=scores,
            row_tokens=self._row_tokens(work.shape[1], first.passed_tokens + first.exact_tokens),
            window_tokens=first.exact_tokens - (work.shape[-2] - stored), stored=stored,
            held=tuple(0 if stored else self.engine.windows[layer].compressed_tokens for layer in members),
            forward_tokens=self.engine.forward_tokens,
            shared_tokens=len(members) > 1 and self.engine.basis.coefficient_rows(len(members)) == 1,
            importance=self.context.at(tuple(members), logical), context_importance=self.context.scores,
        )

    def evict(self, group_index: int, count: int, stats: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Flush ``count`` tokens of a group whose evictor may drop some: the dropped ones are not stored."""
        members = self.engine.groups[group_index]
        blocks = {kind: stack_layers([self.engine.windows[layer].exact.head(kind, count) for layer in members]) for kind in KINDS}
        work = blocks["keys"].float()
        passed = self.engine.windows[members[0]].passed_tokens
        logical = torch.arange(passed, passed + count, device=work.device).expand(work.shape[:-1])
        scores = None
        if self.engine.accumulates:
            scores = torch.stack([self._score_slice(layer, count)[1] for layer in members])
        route = self._eviction_block(group_index, work, logical, stats, scores, 0)
        keep = self.evictor.keep(route)
        self._check_keep(keep, work.shape[:-1])
        if route.shared_tokens:  # one coefficient row per token for the whole group
            keep = keep.any(0, keepdim=True).expand_as(keep)
        keep = self._whole_groups(group_index, keep, route)
        placed = self._placed_leading(group_index, passed, keep)
        index, kept = self._kept_index(keep)
        slots = index.shape[-1]
        if slots:
            gathered = {kind: self._gather_tokens(blocks[kind], index) for kind in KINDS}
            kept_stats = None if stats is None else tuple(s.gather(-1, index) for s in stats)
            info = {"count": count, "dropped": count - slots, "kept_index": index, "blocks": gathered, "placed": min(placed, slots)}
            self._encode_kept(group_index, info, kept_stats, logical.gather(-1, index))
        positions = torch.where(kept, logical.gather(-1, index), -1)
        for member, layer in enumerate(members):
            window = self.engine.windows[layer]
            window.slot_index.append(positions[member], passed, count)
            if self.engine.accumulates:
                stored_scores, block_scores, rest = self._score_slice(layer, count)
                picked = block_scores.gather(-1, index[member]) * kept[member]
                window.scores = torch.cat((stored_scores, picked, rest), dim=-1)
            window.compressed_tokens += slots

    def _placed_leading(self, group_index: int, passed: int, keep: torch.Tensor, members: tuple[int, ...] | None = None) -> int:
        """How many of an evicting flush's first slots hold the block's first positions in every layer, row and head,
        known without a host read: those the evictor always keeps (``Evictor.kept_leading``), where no row is padded;
        ``keep`` [G, B, H, n] must hold them (checked with the flush's other checks, deferred on a GPU)."""
        lead = min(max(0, int(self.evictor.kept_leading()) - passed), keep.shape[-1])
        if lead == 0 or self.engine.padding is not None:
            return 0
        members = self.engine.groups[group_index] if members is None else members

        def fail() -> None:
            raise ComponentError(
                f"pipeline '{self.engine.pipeline.name}', slot 'evictor' ('{self.engine.pipeline.use('evictor')}'): it promises "
                f"to keep the first {self.evictor.kept_leading()} positions of every sequence (kept_leading), and its keep() "
                f"dropped one of positions {passed}..{passed + lead - 1} in layers {list(members)}")

        check(~keep[..., :lead].all(), fail)
        return lead

    def _whole_groups(self, group_index: int, keep: torch.Tensor, route: EvictionBlock, per_layer: bool = False) -> torch.Tensor:
        """``keep`` [G, B, H, n] topped up so that every layer, row and head keeps the same multiple of the
        quantizers' token group (a per-group quantizer packs whole groups): the slots a head would leave
        as fillers hold its best dropped tokens instead (by context importance where the block has it, else
        the latest), so no slot is stored for nothing. ``per_layer``: each layer to its own count (a block of
        several one-layer groups)."""
        tokens = max(self.engine.quantizer(group_index, kind).tokens_per_group() for kind in KINDS)
        if tokens <= 1 or keep.numel() == 0:
            return keep
        counts = keep.sum(-1, keepdim=True)
        # the largest count rounded up to whole token groups, at most the block: on the device (no host read)
        most = counts.amax(dim=(1, 2), keepdim=True) if per_layer else counts.max()
        target = ((most + tokens - 1) // tokens * tokens).clamp(max=keep.shape[-1])
        if route.importance is not None:
            priority = route.importance.double().clamp(-1e300, 1e300)
        else:
            priority = torch.arange(keep.shape[-1], device=keep.device, dtype=torch.float64).expand(keep.shape)
        priority = priority.masked_fill(~route.valid.to(keep.device), -1e301).masked_fill(keep, float("-inf"))
        order = priority.argsort(dim=-1, descending=True, stable=True)
        ranks = torch.empty_like(order).scatter_(-1, order, torch.arange(keep.shape[-1], device=keep.device).expand_as(order))
        topped = keep | (ranks < (target - counts))
        if route.shared_tokens:
            topped = topped[:1].expand_as(topped)
        return topped

    def _score_slice(self, layer: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The accumulated scores of ``layer`` split into stored slots, the ``count`` tokens now leaving the
        window, and the rest of the window (zeros where no query has attended yet)."""
        window = self.engine.windows[layer]
        exact = window.exact
        total = window.compressed_tokens + window.exact_tokens
        scores = window.scores
        if scores is None:
            scores = torch.zeros(*exact.shape()[:2], 0, device=exact.device)
        if scores.shape[-1] < total:
            scores = torch.cat((scores, scores.new_zeros(*scores.shape[:2], total - scores.shape[-1])), dim=-1)
        stored = window.compressed_tokens
        return scores[..., :stored], scores[..., stored : stored + count], scores[..., stored + count :]

    def _encode_kept(self, group_index: int, info: dict, stats=None, positions: torch.Tensor | None = None) -> None:
        """Encode the kept tokens ``info["blocks"]`` of both kinds, with ``info`` the flush in progress (what the encoder
        and its probe read: the block's kept keys and values, ``count`` tokens leaving the window)."""
        self.engine._flush_info = info
        try:
            for kind in KINDS:
                self.engine.encoder.encode(kind, group_index, info["blocks"][kind], stats, positions)
        finally:
            self.engine._flush_info = None

    def reselect(self, group_index: int, count: int) -> None:
        """Flush for a router that re-selects among the stored tokens and the ``count`` leaving the window:
        the kept set is re-encoded from the stored values (bit-exact with the `none` quantizer)."""
        (layer,) = self.engine.groups[group_index]
        window = self.engine.windows[layer]
        stored = window.compressed_tokens
        dtype = window.exact.dtype
        candidates = {}
        for kind in KINDS:
            new = window.exact[kind][..., :count, :]
            candidates[kind] = torch.cat((self.engine.reconstruct(layer, kind, dtype), new), dim=-2) if stored else new
        batch, heads = candidates["keys"].shape[:2]
        fresh = torch.arange(window.passed_tokens, window.passed_tokens + count, device=candidates["keys"].device)
        logical = fresh.expand(batch, heads, count)
        if stored:
            logical = torch.cat((window.positions.long(), logical), dim=-1)
        scores = None
        if self.engine.accumulates:
            stored_scores, block_scores, rest = self._score_slice(layer, count)
            scores = torch.cat((stored_scores, block_scores), dim=-1)
        work = candidates["keys"].float()[None]
        route = self._eviction_block(group_index, work, logical[None], None, None if scores is None else scores[None], stored)
        keep = self.evictor.keep(route)
        self._check_keep(keep, work.shape[:-1])
        index, kept = self._kept_index(keep[0])
        self.engine.stores[group_index] = {kind: GroupStore() for kind in KINDS}
        if index.shape[-1]:
            self._encode_kept(group_index, {"count": count, "blocks": {kind: self._gather_tokens(candidates[kind], index)[None] for kind in KINDS}})
        window.slot_index.replace(torch.where(kept, logical.gather(-1, index), -1), window.passed_tokens + count)
        if scores is not None:
            window.scores = torch.cat((scores.gather(-1, index) * kept, rest), dim=-1)
        window.compressed_tokens = index.shape[-1]

    def rank_kept(self, router: Router, block: RouteBlock, kept_index: torch.Tensor) -> torch.Tensor:
        """Residual ranks [G, B, H, k] for the kept tokens of an evicting flush (``block`` holds only them;
        ``kept_index`` [G, B, H, k] their index in the flushed block). Kept tokens differ between KV heads
        (and between layers when they do not share rows), so the router sees one part per KV head (per layer
        and head when the layers kept different tokens), with its delimiter flags gathered to the part's
        tokens; the byte budget is split evenly between the parts."""
        # one layer (a single-layer group) is the same as itself: no host read
        same = kept_index.shape[0] == 1 or all(torch.equal(kept_index[g], kept_index[0]) for g in range(1, kept_index.shape[0]))
        heads = kept_index.shape[2]
        parts = [(slice(None), h) for h in range(heads)] if same else [
            (slice(g, g + 1), h) for g in range(kept_index.shape[0]) for h in range(heads)
        ]
        ranks = torch.zeros(block.vectors.shape[:-1], dtype=torch.long, device=block.vectors.device)
        for rows, head in parts:
            part = self._route_part(block, kept_index, rows, head, len(parts))
            ranks[rows, :, head : head + 1] = router.assign(part)
        return ranks

    @staticmethod
    def _route_part(block: RouteBlock, kept_index: torch.Tensor, rows: slice, head: int, parts: int) -> RouteBlock:
        """The sub-block of layers ``rows`` and KV head ``head``."""
        changes: dict = {}
        for name in TOKEN_FIELDS:
            value = getattr(block, name)
            if isinstance(value, torch.Tensor):
                changes[name] = value[rows, :, head : head + 1]
        changes["layers"] = tuple(block.layers[rows])
        if block.probe_error is not None:
            changes["probe_error"] = block.probe_error[rows, head : head + 1]
        if block.boundary is not None:
            index = kept_index[rows][0, :, head]  # [B, k]: the part's layers keep the same tokens
            changes["boundary"] = block.boundary.gather(-1, index.to(block.boundary.device))
        if block.budget_bytes is not None:
            changes["budget_bytes"] = block.budget_bytes / parts
        changes["queries"] = None  # per query head; not split here
        return attrs.evolve(block, **changes)

    def physical_mask(self, layer: int, logical: torch.Tensor | None, queries: int, query_heads: int) -> torch.Tensor | None:
        """The attention mask over what ``update`` returned for ``layer`` (stored slots, then the exact window), from
        the model's mask over logical tokens ``logical`` [B|1, 1, q, T] (bool; None = causal, no padding). Unchanged
        when the layer never dropped a token."""
        window = self.engine.windows[layer]
        stored = window.positions
        if stored is None:
            return logical
        batch, heads = window.exact.shape()[:2]
        total = window.passed_tokens + window.exact_tokens
        device = window.exact.device
        if logical is None:
            rows = total - queries + torch.arange(queries, device=device)
            logical = (torch.arange(total, device=device)[None, :] <= rows[:, None])[None, None]
        elif logical.dtype != torch.bool:
            logical = logical == 0  # an additive float mask
        if logical.shape[-1] != total:
            raise CacheStateError(f"layer {layer}: the attention mask covers {logical.shape[-1]} tokens, the cache {total}")
        exact_index = (window.passed_tokens + torch.arange(window.exact_tokens, device=device)).expand(batch, heads, -1)
        index = torch.cat((stored.long().clamp_min(0), exact_index), dim=-1)  # [B, H, T_phys]
        source = logical[:, 0].expand(batch, queries, total)[:, None].expand(batch, heads, queries, total)
        mask = source.gather(-1, index[:, :, None, :].expand(batch, heads, queries, index.shape[-1]))
        filler = torch.cat((stored >= 0, torch.ones_like(exact_index, dtype=torch.bool)), dim=-1)
        mask = mask & filler[:, :, None, :]
        return mask.repeat_interleave(query_heads // heads, dim=1)

    def note_padding(self, mask: torch.Tensor | None, batch: int) -> None:
        """Note which cache indices of this forward are real tokens (the engine's ``padding``, which eviction reads),
        from the model's mask over logical tokens (4-D; None: causal, no padding). Every forward that may flush notes
        it, the decode steps a kernel reads in place included: a block flushed while decoding holds decoded tokens."""
        if mask is not None and mask.dim() == 4:
            allowed = mask if mask.dtype == torch.bool else mask == 0
            self.engine.padding = allowed[:, 0, -1, :].expand(batch, -1).clone()  # the last query sees every real token
        elif mask is None:
            self.engine.padding = None

    def prepare_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor | None:
        """Called by the observing attention before ``layer``'s attention: notes the padding (from the model's mask),
        accumulates attention for routers that use it, and returns the mask for the K/V ``update`` returned (evicted
        tokens are not there)."""
        if not (self.engine.evicts or self.engine.accumulates):
            return mask
        self.note_padding(mask, query.shape[0])
        physical = self.physical_mask(layer, mask, query.shape[-2], query.shape[1])
        if self.engine.accumulates:
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
            if self.engine.padding is not None:  # a padding query gives no attention
                logical = self.engine.seq_length(layer) - queries
                real = self.engine.padding[:, logical + start : logical + stop].to(probs.dtype)
                probs = probs * real[:, None, None, :, None]
            added += probs.sum(dim=(2, 3))
        window = self.engine.windows[layer]
        scores = window.scores
        if scores is None:
            scores = added.new_zeros(batch, heads, 0)
        if scores.shape[-1] < total:
            scores = torch.cat((scores, scores.new_zeros(batch, heads, total - scores.shape[-1])), dim=-1)
        window.scores = scores + added

    def key_valid(self, layer: int) -> torch.Tensor | None:
        """[B, H, T] whether each key ``update`` returns for ``layer`` is a real token (None: all are)."""
        window = self.engine.windows[layer]
        positions = window.positions
        if positions is None and self.engine.padding is None:
            return None
        batch, heads = window.exact.shape()[:2]
        device = window.exact.device
        if positions is None:
            stored = torch.arange(window.compressed_tokens, device=device).expand(batch, heads, -1)
        else:
            stored = positions.long()
        exact_index = (window.passed_tokens + torch.arange(window.exact_tokens, device=device)).expand(batch, heads, -1)
        return self._real_positions(torch.cat((stored, exact_index), dim=-1))[1]
