"""Encoding one block of a basis group: the engine's collaborator for the compress step.

For keys or values of one flushed block ``[G, B, H, n, D]``: the basis encodes coefficients, the kind's
quantizer packs them into the group's store, the router gives every token a residual rank under the
block's byte budget (:mod:`kvweave.engine.budget`), residual entries are packed by the kind's residual
quantizer into per-layer lists (:mod:`kvweave.engine.residuals`), and the probe measures the block's
attention-output error to move budget between groups. Keys stored before the rotary embedding are
un-rotated here (:mod:`kvweave.engine.rotary`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.core.errors import ComponentError
from kvweave.core.host_to_device import device_constant
from kvweave.core.interfaces import KINDS, RouteBlock
from kvweave.core.storage import TensorMap, stack_layers
from kvweave.engine.residuals import add_residuals, begin_residual_fit, encode_residuals, mix_residuals, residual_rows
from kvweave.kernels.miss import misses

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine

#: the float32 copies the probe makes of a group's blocks at once (the exact, the stored and the other kind's): a
#: longer prompt's layers are probed a few at a time
PROBE_BYTES = 1 << 30

#: dtypes whose values float32 holds exactly (a block of them, taken to float32 and back, is itself: an identity
#: basis's coefficients)
_EXACT_IN_FLOAT32 = (torch.bfloat16, torch.float16, torch.float32)


def _owns(tensor: torch.Tensor, others: tuple) -> bool:
    """Whether ``tensor`` holds memory of its own, none of ``others``' (tensors among them)."""
    if tensor._base is not None:
        return False
    place = tensor.untyped_storage().data_ptr()
    return all(place != t.untyped_storage().data_ptr() for t in others if isinstance(t, torch.Tensor))


class BlockEncoder:
    """Encodes flushed blocks into the engine's store (one per engine)."""

    def __init__(self, engine: CompressionEngine) -> None:
        self.engine = engine
        #: what the probe's keys measurement of the block being encoded left for its values measurement, by (group,
        #: flush, first layer of the part); one block's at a time
        self.probe_shared: dict[tuple[int, int, int], dict] = {}
        #: (group, float32 values) the keys' probe of a block made, which the values' encode of the block takes as its
        #: float32 copy; taken or dropped by the next encode
        self.values_work: tuple[int, torch.Tensor] | None = None

    def encode(
        self, kind: str, group_index: int, block: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Encode ``block`` [G, B, H, n, D] of group ``group_index`` into its store and residual lists;
        ``positions`` (broadcast to [G, B, H, n]) are the tokens' cache indices, where keys are un-rotated
        when the pipeline stores them before the rotary embedding."""
        store = self.engine.stores[group_index][kind]
        members = self.engine.groups[group_index]
        exact_block = block
        if self.engine.pre_rope and kind == "keys":
            block = self.engine.rope_keys(block, members, positions, inverse=True).to(block.dtype)
        # a basis storing the vectors as they are: the block is its own coefficients, in float32 only where reconstructed
        identity = self.engine.basis.identity and block.dtype in _EXACT_IN_FLOAT32
        made, self.values_work = self.values_work, None  # the keys' probe's float32 copy of these values, if it made one
        reuse = kind == "values" and not identity and made is not None and made[0] == group_index and made[1].shape == block.shape
        work = made[1] if reuse else block if identity else block.float()
        if store.state is None:
            store.state = self.engine.basis.init_state(block if self.engine.basis.reads_block else work)
        first = store.coefficients.tokens
        quantizer = self.engine.quantizer(group_index, kind)
        residual_quantizer = self.engine.residual_quantizers[kind]
        coefficients = block if identity else self.engine.basis.encode(store.state, work).to(block.dtype)
        packed = self.quantize(kind, quantizer, members, coefficients)
        store.coefficients.append(packed)
        store.flushes += 1
        tokens = block.shape[-2]
        head = self.routed_head(kind, group_index, tokens, quantizer)
        if head == 0:
            return  # nothing reads the block's reconstruction (e.g. the sinks router past the first positions)
        if head < tokens:  # only the leading tokens the router may route are reconstructed (e.g. the sinks)
            packed = quantizer.leading_tokens(packed, head, tokens)
            work = work[..., :head, :]
            if stats is not None:
                stats = (stats[0][..., :head], stats[1][..., :head])
        work = work.float()
        decoded = quantizer.dequantize(packed, torch.float32)
        approx = self.engine.basis.decode_group(store.state, decoded, len(members), start=first)
        entries: list[dict[int, TensorMap]] = [{} for _ in members]
        if self.engine.residual_levels:
            mixing = self.engine.basis.residual_mixing(len(members))
            fixed = self.fixed_ranks(kind, group_index, work.shape[-2], mixing)
            rows = None
            if fixed is None:  # the router reads the block
                source = block[..., : work.shape[-2], :]  # work's values as the block holds them: fewer bytes to read
                difference, miss = misses(source, approx)  # on a GPU one kernel: the block read once
                rows = residual_rows(difference, mixing)
                del difference
                fit = None
                if self.engine.settings.residual_mode == "basis" and any(self.engine.windows[layer].residual_basis[kind] is None for layer in members):
                    # every member's residual basis from its first block, in one batched call queued before the ranks'
                    # host read (whether it worked is read after it): rows are the misses, or their mixed rows
                    fit = begin_residual_fit(rows, max(self.engine.levels))
                route = self.route_block(kind, group_index, work, miss, stats, approx, rows, mixing, tokens)
                kept_index = (self.engine._flush_info or {}).get("kept_index")
                ranks = self.engine.router.assign(route) if kept_index is None else self.engine.eviction.rank_kept(self.engine.router, route, kept_index)
                counts, ends = self.rank_counts(ranks, work.shape[:-1])
                if fit is not None:
                    fitted = fit.basis()
                    for member, layer in enumerate(members):
                        if self.engine.windows[layer].residual_basis[kind] is None:
                            self.engine.windows[layer].residual_basis[kind] = fitted[member].clone()
            else:
                counts, ends = self.fixed_counts(fixed, block.shape[1] * block.shape[2], len(members))
            missing = work - approx if rows is None else rows  # [G, B, H, n, D], float32
            if any(self.engine.windows[layer].residual_basis[kind] is None for layer in members):
                missing = missing.to(block.dtype)  # channels kept as they are: in the block's dtype
            entries = self.encode_members(kind, members, missing, ranks if fixed is None else fixed, counts, residual_quantizer,
                                          block.dtype)
            if mixing is None:
                own = _owns(approx, (block, work, decoded, *packed.values()))  # else a decode may hand back what is stored
                for member, layer in enumerate(members):
                    added = add_residuals(approx[member], entries[member], residual_quantizer, self.engine.router.gates(layer, kind),
                                          self.engine.windows[layer].residual_basis[kind], inplace=own)
                    if not own:
                        approx[member] = added
            self.append_entries(kind, members, entries, ends, [tokens] * len(members), block.shape[1] * block.shape[2])
            if mixing is not None and self.engine.probe.wants(store.flushes):  # rows of the whole group, mixed per layer
                gates = [self.engine.router.gates(layer, kind) for layer in members]
                bases = [self.engine.windows[layer].residual_basis[kind] for layer in members]
                approx = torch.stack([mix_residuals(approx[m], m, entries, residual_quantizer, mixing, gates, bases) for m in range(len(members))])  # tokens relative to the block
        if self.engine.probe.wants(store.flushes):
            if self.engine.pre_rope and kind == "keys":  # the probe compares attention, which sees rotated keys
                approx = self.engine.rope_keys(approx, members, positions, inverse=False)
            # the block's float32 copy made above, where it holds the same values (no second copy of the block)
            same = exact_block is block and work.shape == block.shape and work.dtype == torch.float32
            self.probe(kind, group_index, work if same else exact_block, approx)

    def quantize(self, kind: str, quantizer, members: tuple[int, ...], coefficients: torch.Tensor) -> TensorMap:
        """``coefficients`` [G, B, H, n, r] of ``members`` packed by ``quantizer``: keys with each layer's channels
        weighed by its queries' energy where the pipeline records it (engine/energy.py)."""
        if kind == "keys" and self.engine.energy is not None:
            return quantizer.quantize(coefficients, channel_weights=self.engine.energy.means(members))  # type: ignore[call-arg]
        return quantizer.quantize(coefficients)

    @staticmethod
    def fixed_counts(fixed: tuple[tuple[int, int, int], ...], rows: int, members: int) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
        """What :meth:`rank_counts` reads for ranks fixed by position (runs ``(start, stop, rank)`` in every one of a
        block's ``rows`` rows and heads), on the host: each member's entry count by rank, and where its entries end."""
        levels = {level for _, _, level in fixed}
        counts = {rank: rows * sum(stop - start for start, stop, level in fixed if level == rank) for rank in levels}
        ends = {rank: max(stop for _, stop, level in fixed if level == rank) for rank in levels}
        return [counts] * members, [ends] * members

    def append_entries(self, kind: str, members: tuple[int, ...], entries: list[dict[int, TensorMap]],
                       ends: list[dict[int, int]], tokens: list[int], rows: int) -> None:
        """Each member's residual entries of a block (tokens relative to it) appended to its lists after the slots it
        holds already: ``ends`` where each rank's entries end in the block, ``tokens`` the block's slots, per member."""
        for member, layer in enumerate(members):
            window = self.engine.windows[layer]
            held = window.compressed_tokens
            for rank, fields in entries[member].items():
                window.residuals[kind][rank].append({**fields, "token": fields["token"] + held} if held else fields, held, tokens[member], rows,
                                                    held + ends[member][rank])

    def routed_head(self, kind: str, group_index: int, tokens: int, quantizer) -> int:
        """How many leading tokens of a ``tokens``-token block to reconstruct and route: every one where the
        probe measures the block, where the kernel indexes residual tiles or where the tokens the router may route are
        not known to be in position order (an evicting flush's, past the first positions its evictor always keeps);
        otherwise none without residual levels, else those the router may route (:meth:`Router.routed_tokens`)
        rounded up to the quantizer's token groups, unless a residual basis is still to be fitted from the whole
        block."""
        engine = self.engine
        if engine.probe.wants(engine.stores[group_index][kind].flushes):
            return tokens
        if not engine.residual_levels:
            return 0
        if engine.kernel.builds_residual_tiles:
            return tokens
        limit = engine.router.routed_tokens(kind, engine.windows[engine.groups[group_index][0]].passed_tokens)
        if limit == 0:
            return 0
        if limit is None or limit >= tokens or limit > self._by_position(kind, group_index, tokens):
            return tokens
        group = quantizer.tokens_per_group()
        return min(tokens, -(-limit // group) * group)

    def _by_position(self, kind: str, group_index: int, tokens: int) -> int:
        """How many leading tokens of a ``tokens``-token block a router's answer by positions holds for: all of them
        where the block is in position order, the slots an evicting flush knows hold its first positions
        (``placed``: the evictor's ``kept_leading``) where it drops tokens, none while a residual basis waits to be
        fitted from the whole block."""
        engine = self.engine
        if engine.settings.residual_mode == "basis" and any(
                engine.windows[layer].residual_basis[kind] is None for layer in engine.groups[group_index]):
            return 0
        info = engine._flush_info or {}
        return tokens if info.get("kept_index") is None else int(info.get("placed", 0))

    def fixed_ranks(self, kind: str, group_index: int, tokens: int,
                    mixing: torch.Tensor | None) -> tuple[tuple[int, int, int], ...] | None:
        """The block's first ``tokens`` tokens' ranks where the router gives them without the block
        (:meth:`Router.fixed_ranks`: runs of positions, the same in every row and head, so the residual entries are
        found without reading ranks on the host); None where it must read the block, a run reaches tokens not in position
        order (an evicting flush's kept tokens past the first positions its evictor always keeps), rows are mixed across
        layers, or a residual basis is still to be fitted from the block."""
        engine = self.engine
        placed = 0 if mixing is not None else self._by_position(kind, group_index, tokens)
        if placed == 0:
            return None
        runs = engine.router.fixed_ranks(kind, engine.windows[engine.groups[group_index][0]].passed_tokens, tokens)
        if runs is None:
            return None
        runs = tuple((int(start), int(stop), int(rank)) for start, stop, rank in runs)
        if placed < tokens and any(stop > placed for _, stop, _ in runs):
            return None  # a run past the slots known to hold their positions: the router reads the kept tokens
        ends = [0] + [bound for start, stop, _ in runs for bound in (start, stop)] + [tokens]
        if any(rank not in engine.levels or rank == 0 for _, _, rank in runs) or any(
                later < earlier for earlier, later in zip(ends, ends[1:])) or any(start == stop for start, stop, _ in runs):
            raise ComponentError(
                f"router '{engine.pipeline.use('router')}' fixed ranks {runs} for a block of {tokens} tokens; expected "
                f"runs (start, stop, rank) ascending and apart within it, ranks in {sorted(set(engine.levels) - {0})}"
            )
        return runs

    def route_block(
        self, kind: str, group_index: int, work: torch.Tensor, miss: torch.Tensor,
        stats: tuple[torch.Tensor, torch.Tensor] | None, approx: torch.Tensor | None = None, rows: torch.Tensor | None = None,
        mixing: torch.Tensor | None = None, tokens: int | None = None,
    ) -> RouteBlock:
        """The router's view of the block's first ``work.shape[-2]`` tokens; ``tokens``: the whole block's count
        (the residual budget's share), when only its leading tokens are routed."""
        members = self.engine.groups[group_index]
        store = self.engine.stores[group_index][kind]
        mass, spike = stats if stats is not None else (None, None)
        first = self.engine.windows[members[0]].passed_tokens
        info = self.engine._flush_info or {}  # an evicting flush: the block holds only the kept tokens
        tokens = work.shape[-2] if tokens is None else tokens
        routed = work.shape[-2]
        return RouteBlock(
            layers=tuple(members),
            kind=kind,
            vectors=work,
            level_bytes=self.engine.budget.level_bytes[kind],
            budget_bytes=self.engine.budget.residual_budget(self.engine, group_index, kind, tokens, info.get("dropped", 0)),
            attention_mass=mass,
            attention_spike=spike,
            boundary=self.engine.observer.boundaries(first, info.get("count", routed), work.device),
            probe_error=store.probe_error,
            miss=miss,
            approx=approx,
            rows=rows,
            mixing=mixing,
            **self.route_queries(members),
            first=first,
            state=self.engine.stores[group_index]["keys"].route_state,
        )

    def route_queries(self, members: tuple[int, ...]) -> dict:
        """The observed queries of the group's layers for the router (the probe's selection when it made one)."""
        pairs = [self.engine.observer.probe_queries(layer) if self.engine.observer.active else None for layer in members]
        if any(pair is None for pair in pairs) or len({pair[0].shape for pair in pairs}) != 1:
            return {}
        return {
            "queries": torch.stack([pair[0] for pair in pairs]),
            "query_positions": torch.stack([pair[1] for pair in pairs]),
            "query_scale": self.engine.observer.scaling,
        }

    def probe(self, kind: str, group_index: int, block: torch.Tensor, approx: torch.Tensor) -> None:
        """Eq. (3) on the block just encoded, for the observed queries of every layer of the group at once; moves
        budget between groups."""
        store = self.engine.stores[group_index][kind]
        members = self.engine.groups[group_index]
        windows = [self.engine.windows[layer].exact for layer in members]
        n = block.shape[-2]
        dtype = torch.float32
        info = self.engine._flush_info  # an evicting flush: the kept tokens of both kinds, the window after them
        start = info["count"] if info else n
        other_kind = "values" if kind == "keys" else "keys"
        # layers at a time: all of them for a decode step's block, fewer for a long prompt's (its float32 copies)
        step = max(1, min(len(members), PROBE_BYTES // max(1, block[0].numel() * 4 * 3)))
        errors = []
        shares = self.engine.probe.shares_products
        values_work = None
        if kind == "keys":
            self.probe_shared.clear()
            if not info:  # the exact values in float32 for every part, kept as the values' encode's own copy (work)
                values_work = torch.empty((len(members), *windows[0]["values"][..., :n, :].shape), dtype=dtype, device=block.device)
                for member, exact in enumerate(windows):
                    values_work[member].copy_(exact["values"][..., :n, :])
                self.values_work = (group_index, values_work)
        for first in range(0, len(members), step):
            part = slice(first, first + step)
            extra = {}
            if shares:  # the keys' measurement fills a dict, the values' one of the same block takes it
                place = (group_index, store.flushes, first)
                extra["shared"] = self.probe_shared.setdefault(place, {}) if kind == "keys" else self.probe_shared.pop(place, None)
            if info:
                other = info["blocks"][other_kind][part].to(dtype)
            elif values_work is not None:
                other = values_work[part]
            elif shares and not self.engine.probe.reads_other(kind, extra["shared"]):
                other = None  # the keys' measurement kept what the values' one would have read the keys for
            else:
                other = stack_layers([exact[other_kind][..., :n, :] for exact in windows[part]], dtype)
            exact_block, approx_block = block[part].to(dtype), approx[part].to(dtype)
            keys, approx_keys, values, approx_values = (
                (exact_block, approx_block, other, other) if kind == "keys" else (other, other, exact_block, approx_block))
            queries = stack_layers([self.engine.observer.queries(layer) for layer in members[part]], dtype)
            context = [stack_layers([exact[k][..., start:, :] for exact in windows[part]], dtype) for k in ("keys", "values")]
            errors.append(self.engine.probe.measure_group(queries, keys, values, approx_keys, approx_values, *context,
                                                          self.engine.observer.scaling, **extra))
        store.probe_error = errors[0] if len(errors) == 1 else torch.cat(errors)
        store.pending_errors.append(store.probe_error)  # the share moves once every group has encoded (no host read here)

    def apply_probe_shares(self) -> None:
        """After every group has encoded its blocks of this forward: the probes' new budget shares take
        effect together, renormalized to average 1 so the total budget holds. The probe's ``adjust`` runs here, for
        each error in the order measured, so reading the errors to the host waits for the device once a forward, not
        once a block."""
        self.probe_shared.clear()  # a keys' measurement whose values' one did not come holds nothing past the forward
        self.values_work = None
        for kind in KINDS:
            stores = [group[kind] for group in self.engine.stores]
            for s in stores:
                for errors in s.pending_errors:
                    s.next_share = self.engine.probe.adjust(s.share, errors, s.probe_state)
                s.pending_errors = []
            if not any(s.next_share is not None for s in stores):
                continue
            for s in stores:
                if s.next_share is not None:
                    s.share, s.next_share = s.next_share, None
            mean = sum(s.share for s in stores) / len(stores)
            for s in stores:
                s.share /= mean

    def rank_counts(self, ranks: torch.Tensor, shape: torch.Size) -> tuple[list[dict[int, int]], list[dict[int, int]]]:
        """Each member's entry count by rank level (``ranks`` [G, B, H, n]) and where its entries end in the block (the
        last one's token + 1, what a residual list's bits must cover), read to the host in one read; refuses ranks
        outside the pipeline's levels or a wrong shape."""
        if ranks.shape != shape:
            raise ComponentError(
                f"router '{self.engine.pipeline.use('router')}' returned ranks shaped {tuple(ranks.shape)}; expected {tuple(shape)}")
        levels = sorted(self.engine.levels)
        width = len(levels) + 1  # the levels, then one place for a stray rank
        table = device_constant(levels, ranks.dtype, ranks.device)
        at = torch.searchsorted(table, ranks.contiguous()).clamp_max(len(levels) - 1)
        code = torch.where(table[at] == ranks, at, len(levels))
        # each member's count and last token by level as reductions over a one-hot of the codes: a scatter into the
        # members' few places made every token contend for them (2.2 ms a flush of depthweave-kv's prompt at 32K, H200)
        onehot = code.unsqueeze(-1) == torch.arange(width, device=ranks.device)  # [G, B, H, n, width]
        token = torch.arange(1, shape[-1] + 1, device=ranks.device).view(-1, 1)  # [n, 1]
        dims = tuple(range(1, ranks.dim()))
        counts = onehot.sum(dim=dims)
        ends = torch.where(onehot, token, 0).amax(dim=dims) if shape[-1] else torch.zeros_like(counts)
        counts, ends = torch.stack((counts, ends)).tolist()
        if any(row[-1] for row in counts):
            stray = set(torch.unique(ranks).tolist()) - set(levels)
            raise ComponentError(
                f"router '{self.engine.pipeline.use('router')}' returned ranks {sorted(stray)}; expected values in {levels}")
        present = [[(i, rank) for i, rank in enumerate(levels) if rank and row[i]] for row in counts]
        return ([{rank: counts[m][i] for i, rank in places} for m, places in enumerate(present)],
                [{rank: ends[m][i] for i, rank in places} for m, places in enumerate(present)])

    def encode_members(
        self, kind: str, members: tuple[int, ...], missing: torch.Tensor,
        ranks: torch.Tensor | tuple[tuple[int, int, int], ...], counts: list[dict[int, int]], quantizer,
        dtype: torch.dtype | None = None,
    ) -> list[dict[int, TensorMap]]:
        """Every member's residual entries (rank -> fields, rows and tokens relative to the member and block) from the
        group's ``missing`` [G, B, H, n, D]: one :func:`encode_residuals` call for the group where the residual
        quantizer packs each entry alone (one token a group), split by the host's ``counts``; one a member otherwise.
        ``dtype`` (the block's): what the values are quantized from."""
        windows = [self.engine.windows[layer] for layer in members]
        bases = [w.residual_basis[kind] for w in windows]
        if quantizer.tokens_per_group() != 1 or len(members) == 1 or len({b is None for b in bases}) > 1:
            return [encode_residuals(missing[m], ranks if not isinstance(ranks, torch.Tensor) else ranks[m], quantizer,
                                     bases[m], counts[m], dtype) for m in range(len(members))]
        group, batch, heads = missing.shape[:3]
        basis = None if bases[0] is None else torch.stack(bases).flatten(0, 1)
        flat_ranks = ranks.flatten(0, 1) if isinstance(ranks, torch.Tensor) else ranks
        totals = {rank: sum(c.get(rank, 0) for c in counts) for rank in set().union(*counts)}
        joint = encode_residuals(missing.flatten(0, 1), flat_ranks, quantizer, basis, totals, dtype)
        out: list[dict[int, TensorMap]] = [{} for _ in members]
        for rank, fields in joint.items():
            sizes = [c.get(rank, 0) for c in counts]
            parts = {name: t.split(sizes) for name, t in fields.items()}
            for m in range(group):
                if sizes[m]:  # copies: a part kept as a view would hold the whole group's storage
                    out[m][rank] = {name: part[m].clone() for name, part in parts.items() if name != "row"}
                    out[m][rank]["row"] = parts["row"][m] - m * batch * heads
        return out
