"""The compression engine behind :class:`kvweave.engine.cache.KVWeaveCache`.

Per layer, new tokens enter an exact window (model dtype). Once every layer of a basis group holds
``recent_window + block_tokens`` exact tokens, the oldest whole blocks leave the window: the basis
encodes them to coefficients ``[S, B, H, n, r]``, the quantizer packs those, the router gives every
token a residual rank, and a token at rank ``rho > 0`` keeps the ``rho`` largest channels of what the
packed coefficients miss (:mod:`kvweave.engine.residuals`). The exact copies are then dropped, so the
memory is really freed.

``update`` returns the K/V the model attends over: the stored blocks reconstructed, then the exact
window (the reference path). Tokens are compressed after the forward pass that added them, so a
prompt attends to itself exactly during prefill and compressed afterwards.

Budget: when the router has a ``target_reduction``, each group's K (and V) storage is held to its share
of ``16-bit bytes / target_reduction`` for the tokens cached so far, counting its coefficients, basis
state, residuals and its layers' exact windows; the residuals of a block get what is left, and the probe
moves budget between groups (shares stay 1 on average). See docs/depthweave.md.

Eviction (a pipeline whose ``evictor`` slot drops tokens) is the engine's collaborator
:class:`kvweave.engine.eviction.Eviction`; the stored state is in :mod:`kvweave.engine.store`.
Keys and values may take different quantizers (``keys.quantizer`` / ``values.quantizer`` slots).
"""

from __future__ import annotations

import torch

from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.evictor import Evictor
from kvweave.core.interfaces import KINDS, AttentionKernel, BasisBuilder, ModelShape, Probe, Quantizer, RouteBlock, Router
from kvweave.core.registry import ResolvedPipeline
from kvweave.core.storage import TensorMap, tensor_bytes
from kvweave.core.view import KindView, LayerView, ResidualLevelView
from kvweave.engine.budget import BudgetPlan
from kvweave.engine.eviction import Eviction
from kvweave.engine.observation import ATTENTION_NAME, Observer
from kvweave.engine.residuals import TILE_TOKENS, add_residuals, encode_residuals, fit_residual_basis, mix_residuals, residual_rows
from kvweave.engine.store import GroupStore, LayerWindow


class CompressionEngine:
    """Holds every stored tensor of a compressed cache and does the encoding and reconstruction."""

    def __init__(self, pipeline: ResolvedPipeline, shape: ModelShape) -> None:
        self.pipeline = pipeline
        self.shape = shape
        self.settings = pipeline.settings
        self.basis: BasisBuilder = pipeline.component("basis")  # type: ignore[assignment]
        self.router: Router = pipeline.component("router")  # type: ignore[assignment]
        self.probe: Probe = pipeline.component("probe")  # type: ignore[assignment]
        self.kernel: AttentionKernel = pipeline.component("kernel")  # type: ignore[assignment]
        self.evictor: Evictor = pipeline.component("evictor")  # type: ignore[assignment]
        #: per kind: the quantizer of the coefficients and of the residuals (a kind's own slot, else the shared one)
        self.quantizers: dict[str, Quantizer] = {
            kind: pipeline.component_for("quantizer", kind).for_kind(kind) for kind in KINDS  # type: ignore[attr-defined]
        }
        self.residual_quantizers: dict[str, Quantizer] = {
            kind: pipeline.component_for("residual_quantizer", kind) for kind in KINDS  # type: ignore[misc]
        }
        self.quantizer: Quantizer = pipeline.component("quantizer")  # type: ignore[assignment]  # the shared slot
        self.residual_quantizer: Quantizer = pipeline.component("residual_quantizer")  # type: ignore[assignment]
        for slot in pipeline.slots:
            pipeline.component(slot).check_model(shape)
        self.groups = self.basis.layer_groups(shape)
        self.group_of = self._index_groups()
        where = f"pipeline '{pipeline.name}'"
        for kind in KINDS:
            slot = pipeline.slot_for("quantizer", kind)
            self.quantizers[kind].check_width(self.basis.coefficient_width(shape), f"{where}, slot '{slot}' (coefficients)")
        self.levels = tuple(self.router.levels())
        for rank in self.levels:
            if rank > shape.head_dim or rank < 0:
                raise ModelError(
                    f"{where}, slot 'router': rank level {rank} is outside 0..head_dim ({shape.head_dim}); a router "
                    "gives residual ranks, dropping tokens is the 'evictor' slot's work"
                )
            for kind in KINDS:
                if rank > 0:
                    slot = pipeline.slot_for("residual_quantizer", kind)
                    self.residual_quantizers[kind].check_width(rank, f"{where}, slot '{slot}' (rank level {rank})")
        self.evicts = bool(self.evictor.evicts)
        self.residual_levels = tuple(rank for rank in self.levels if rank > 0)
        self.accumulates = self.evicts and bool(self.evictor.accumulates)
        self.reselects = self.evicts and bool(self.evictor.reselects)
        self.eviction = Eviction(self, self.evictor)
        if self.evicts:
            self.eviction.check(where)
        for kind in KINDS:
            group = self.quantizers[kind].tokens_per_group()
            if self.settings.block_tokens % group:
                slot = pipeline.slot_for("quantizer", kind)
                raise ModelError(
                    f"{where}, slot '{slot}' ('{pipeline.use(slot)}'): it packs groups of {group} tokens, "
                    f"which must divide the pipeline's block_tokens ({self.settings.block_tokens})"
                )
        self.budget = BudgetPlan.for_engine(self)  # raises BudgetError when the target cannot be met
        observes = self.router.needs_attention or self.probe.needs_queries or (self.evicts and self.evictor.needs_attention)
        self.observer = Observer(shape, pipeline.settings.observe_queries if observes else 0)
        if self.probe.selects_queries:
            self.observer.selector = self.probe.select_queries
        self.boundary_ids: torch.Tensor | None = None
        self.windows = [LayerWindow(self.levels) for _ in range(shape.num_layers)]
        self.stores = [{kind: GroupStore() for kind in KINDS} for _ in self.groups]
        self.pending: set[int] = set()
        self.returned_keys: dict[int, torch.Tensor] = {}
        #: the model's attention must report to this cache (queries, masks of evicted tokens, attention)
        self.own_attention = self.observer.active or self.evicts or self.accumulates or not self.kernel.materializes
        #: what a kernel that reads the packed storage in place keeps between calls (segment tables, ...)
        self.kernel_state: dict = {}
        self.padding: torch.Tensor | None = None  # bool [B, T]: False for padding (from the attention mask)
        self.forward_tokens = 0  # tokens of the forward pass in progress
        self._flush_info: dict | None = None  # the flush in progress, when it evicts
        self.kernel.check_engine(self)

    def _index_groups(self) -> dict[int, tuple[int, int]]:
        group_of: dict[int, tuple[int, int]] = {}
        for group_index, members in enumerate(self.groups):
            for member, layer in enumerate(members):
                if layer in group_of or not 0 <= layer < self.shape.num_layers:
                    raise ComponentError(
                        f"pipeline '{self.pipeline.name}': basis '{self.pipeline.slots['basis'].use}' returned layer "
                        f"groups {self.groups}, which are not a partition of layers 0..{self.shape.num_layers - 1}"
                    )
                group_of[layer] = (group_index, member)
        if len(group_of) != self.shape.num_layers:
            missing = sorted(set(range(self.shape.num_layers)) - set(group_of))
            raise ComponentError(f"pipeline '{self.pipeline.name}': layers {missing} are in no basis group")
        return group_of

    # ----------------------------------------------------------------------------------- update
    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, materialize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Append ``keys``/``values`` [B, H, q, D] to ``layer``; return its full K/V [B, H, T, D] (None with
        ``materialize=False``: filling a cache without attention, e.g. :mod:`kvweave.engine.synthetic`)."""
        if not 0 <= layer < self.shape.num_layers:
            raise CacheStateError(f"layer index {layer} is outside the cache's {self.shape.num_layers} layers")
        if keys.shape[1] != self.shape.num_kv_heads or keys.shape[-1] != self.shape.head_dim:
            raise ModelError(
                f"layer {layer} sent keys shaped {tuple(keys.shape)}; the cache was built for "
                f"{self.shape.num_kv_heads} KV heads of dim {self.shape.head_dim}"
            )
        if layer == 0:
            self.observer.start_forward(keys.shape[-2])
            self.forward_tokens = keys.shape[-2]
        if self.pending and self.group_of[layer][0] in self.pending:
            raise CacheStateError(
                f"pipeline '{self.pipeline.name}' needs the model's attention to report to the cache (recent queries, "
                f"the mask of evicted tokens), but the model's attention did not report them; build the cache with build_cache(pipeline, model) so "
                f"the model uses '{ATTENTION_NAME}' attention"
            )
        window = self.windows[layer]
        for kind, new in zip(KINDS, (keys, values)):
            old = window.exact[kind]
            window.exact[kind] = new if old is None else torch.cat((old, new), dim=-2)
        if self.reads_in_place(keys.shape[-2]) or not materialize:  # the kernel reads the packed tokens itself
            full = (window.exact["keys"], window.exact["values"])
        else:
            full = tuple(self._full(layer, kind) for kind in KINDS)
        if self.own_attention:
            self.returned_keys[layer] = full[0]  # lets the attention call tell it belongs to this cache
        group_index, member = self.group_of[layer]
        if self.settings.compress and member == len(self.groups[group_index]) - 1:
            if self.own_attention:
                self.pending.add(group_index)  # flushed by after_attention, once the attention has run
            else:
                self._flush(group_index)
        return full if materialize else None  # type: ignore[return-value]

    def reads_in_place(self, new_tokens: int) -> bool:
        """Whether the attention of a forward of ``new_tokens`` tokens goes to the pipeline's kernel, which
        reads the packed storage in place (one-token forwards with a kernel that does not materialize)."""
        return new_tokens == 1 and not self.kernel.materializes

    def owns(self, layer: int, keys: torch.Tensor) -> bool:
        """Whether ``keys`` are what this cache's ``update`` just returned for ``layer``."""
        return self.returned_keys.get(layer) is keys

    def after_attention(self, layer: int) -> None:
        """Called by the observing attention after ``layer``'s attention: flush its group if it waits."""
        self.returned_keys.pop(layer, None)
        group_index, member = self.group_of[layer]
        if group_index in self.pending and member == len(self.groups[group_index]) - 1:
            self.pending.discard(group_index)
            self._flush(group_index)

    def materialize(self, layer: int, kind: str) -> torch.Tensor:
        """``layer``'s ``kind`` ("keys"/"values") as the reference path attends over: the packed tokens
        reconstructed, then the exact window, [B, H, T_stored, D] in the model's dtype."""
        return self._full(layer, kind)

    def replace_router(self, router: Router) -> Router:
        """Route with ``router`` from the next flush on (same levels; training swaps in routers that record
        what they see); returns the router it replaced."""
        if tuple(router.levels()) != self.levels:
            raise ComponentError(f"pipeline '{self.pipeline.name}': a replacement router must have the levels {self.levels}, not {tuple(router.levels())}")
        previous, self.router = self.router, router
        return previous

    def _full(self, layer: int, kind: str) -> torch.Tensor:
        exact = self.windows[layer].exact[kind]
        if self.windows[layer].compressed_tokens == 0:
            return exact  # type: ignore[return-value]
        return torch.cat((self.reconstruct(layer, kind, exact.dtype), exact), dim=-2)  # type: ignore[union-attr]

    # ------------------------------------------------------------------------------- compress
    def _flush(self, group_index: int) -> None:
        members = self.groups[group_index]
        ready = min(self.windows[layer].exact_tokens for layer in members) - self.settings.recent_window
        count = (ready // self.settings.block_tokens) * self.settings.block_tokens
        if count <= 0:
            return
        # attention statistics need the keys as they are before this block is encoded (once for K and V)
        wants_stats = (self.router.needs_attention and self.residual_levels) or (self.evicts and self.evictor.needs_attention)
        stats = self._attention_stats(members, count) if wants_stats else None
        if self.reselects:
            self.eviction.reselect(group_index, count)
        elif self.evicts:
            self.eviction.evict(group_index, count, stats)
        else:
            for kind in KINDS:
                block = torch.stack([self.windows[layer].exact[kind][..., :count, :] for layer in members])
                self._encode(kind, group_index, block, stats)
            for layer in members:
                self.windows[layer].compressed_tokens += count
        for layer in members:
            window = self.windows[layer]
            for kind in KINDS:
                # clone: a slice would keep the whole old window's storage alive
                window.exact[kind] = window.exact[kind][..., count:, :].clone()
            window.passed_tokens += count
        self.observer.forget_selection(members)
        self.observer.forget_boundaries(min(w.passed_tokens for w in self.windows))
        if self.evicts and not self.residual_levels and not self.probe.needs_queries:
            self.observer.forget_queries(members)  # eviction uses only the queries of the forward that flushes
        if group_index == len(self.groups) - 1:
            self._apply_probe_shares()

    def _attention_stats(self, members: tuple[int, ...], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention mass and spike [G, B, H, count] of the observed queries on the block's tokens."""
        reader = getattr(self.kernel, "packed_logsumexp", None)
        if reader is not None and not self.evicts:  # normalized over the packed tokens read in place
            stats = []
            for layer in members:
                window = self.windows[layer]
                lse = None
                if window.compressed_tokens:
                    lse = reader(self, layer, self.observer.queries(layer), self.observer.scaling or self.shape.head_dim**-0.5)
                stats.append(self.observer.attention_stats_exact(layer, window.exact["keys"], lse, count))
            return torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
        stats = [
            self.observer.attention_stats(
                layer, self._full(layer, "keys"), count, self.windows[layer].compressed_tokens,
                self.eviction.key_valid(layer) if self.evicts else None,
            )
            for layer in members
        ]
        return torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])

    def _encode(
        self, kind: str, group_index: int, block: torch.Tensor, stats: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> None:
        """Encode ``block`` [G, B, H, n, D] of group ``group_index`` into its store and residual lists."""
        store = self.stores[group_index][kind]
        members = self.groups[group_index]
        work = block.float()
        if store.state is None:
            store.state = self.basis.init_state(work)
        first = store.coefficients.tokens
        quantizer = self.quantizers[kind]
        residual_quantizer = self.residual_quantizers[kind]
        packed = quantizer.quantize(self.basis.encode(store.state, work).to(block.dtype))
        store.coefficients.append(packed)
        store.flushes += 1
        if not self.residual_levels and not self.probe.wants(store.flushes):
            return
        decoded = quantizer.dequantize(packed, torch.float32)
        approx = torch.stack([self.basis.decode(store.state, decoded, m, start=first) for m in range(len(members))])
        entries: list[dict[int, TensorMap]] = [{} for _ in members]
        if self.residual_levels:
            miss = (work - approx).norm(dim=-1) / work.norm(dim=-1).clamp_min(1e-9)
            mixing = self.basis.residual_mixing(len(members))
            rows = residual_rows(work - approx, mixing)
            route = self._route_block(kind, group_index, work, miss, stats, approx, rows, mixing)
            kept_index = (self._flush_info or {}).get("kept_index")
            ranks = self.router.assign(route) if kept_index is None else self.eviction.rank_kept(self.router, route, kept_index)
            self._check_ranks(ranks, work.shape[:-1])
            if self.settings.residual_mode == "basis" and any(self.windows[layer].residual_basis[kind] is None for layer in members):
                # every member's residual basis from its first block, fitted in one batched call
                fitted = fit_residual_basis(rows, max(self.levels))  # rows: the misses, or their mixed rows
                for member, layer in enumerate(members):
                    if self.windows[layer].residual_basis[kind] is None:
                        self.windows[layer].residual_basis[kind] = fitted[member].clone()
            for member, layer in enumerate(members):
                missing = (work[member] - approx[member] if mixing is None else rows[member]).to(block.dtype)
                window = self.windows[layer]
                basis = window.residual_basis[kind]
                entries[member] = encode_residuals(missing, ranks[member], residual_quantizer, basis)
                if mixing is None:
                    approx[member] = add_residuals(approx[member], entries[member], residual_quantizer, self.router.gates(layer, kind), basis)
                for rank, fields in entries[member].items():
                    fields["token"] = fields["token"] + self.windows[layer].compressed_tokens
                    self.windows[layer].residuals[kind][rank].append(fields)
            if mixing is not None and self.probe.wants(store.flushes):  # rows of the whole group, mixed per layer
                relative = [{rank: {**f, "token": f["token"] - self.windows[layer].compressed_tokens} for rank, f in e.items()} for e, layer in zip(entries, members)]
                gates = [self.router.gates(layer, kind) for layer in members]
                bases = [self.windows[layer].residual_basis[kind] for layer in members]
                approx = torch.stack([mix_residuals(approx[m], m, relative, residual_quantizer, mixing, gates, bases) for m in range(len(members))])
        if self.residual_levels and not self.kernel.materializes:  # the kernel's tile index, built as entries arrive
            rows = block.shape[1] * block.shape[2]
            for layer in members:
                tiles = (self.windows[layer].compressed_tokens + block.shape[-2]) // TILE_TOKENS
                for lists in self.windows[layer].residuals[kind].values():
                    lists.tile_index(rows, tiles, block.device)
        if self.probe.wants(store.flushes):
            self._probe(kind, group_index, block, approx)

    def _route_block(
        self, kind: str, group_index: int, work: torch.Tensor, miss: torch.Tensor,
        stats: tuple[torch.Tensor, torch.Tensor] | None, approx: torch.Tensor | None = None, rows: torch.Tensor | None = None,
        mixing: torch.Tensor | None = None,
    ) -> RouteBlock:
        members = self.groups[group_index]
        store = self.stores[group_index][kind]
        mass, spike = stats if stats is not None else (None, None)
        first = self.windows[members[0]].passed_tokens
        info = self._flush_info or {}  # an evicting flush: the block holds only the kept tokens
        return RouteBlock(
            layers=tuple(members),
            kind=kind,
            vectors=work,
            level_bytes=self.budget.level_bytes[kind],
            budget_bytes=self.budget.residual_budget(self, group_index, kind, work.shape[-2], info.get("dropped", 0)),
            attention_mass=mass,
            attention_spike=spike,
            boundary=self.observer.boundaries(first, info.get("count", work.shape[-2])),
            probe_error=store.probe_error,
            miss=miss,
            approx=approx,
            rows=rows,
            mixing=mixing,
            **self._route_queries(members),
            first=first,
            state=self.stores[group_index]["keys"].route_state,
        )

    def _route_queries(self, members: tuple[int, ...]) -> dict:
        """The observed queries of the group's layers for the router (the probe's selection when it made one)."""
        pairs = [self.observer.probe_queries(layer) if self.observer.active else None for layer in members]
        if any(pair is None for pair in pairs) or len({pair[0].shape for pair in pairs}) != 1:
            return {}
        return {
            "queries": torch.stack([pair[0] for pair in pairs]),
            "query_positions": torch.stack([pair[1] for pair in pairs]),
            "query_scale": self.observer.scaling,
        }

    def _probe(self, kind: str, group_index: int, block: torch.Tensor, approx: torch.Tensor) -> None:
        """Eq. (3) on the block just encoded, for the observed queries; moves budget between groups."""
        store = self.stores[group_index][kind]
        errors = []
        for member, layer in enumerate(self.groups[group_index]):
            queries = self.observer.queries(layer)
            exact_k = self.windows[layer].exact["keys"]
            exact_v = self.windows[layer].exact["values"]
            n = block.shape[-2]
            dtype = torch.float32
            info = self._flush_info  # an evicting flush: the kept tokens of both kinds, the window after them
            other = {k: (info["blocks"][k][member] if info else exact[..., :n, :]) for k, exact in (("keys", exact_k), ("values", exact_v))}
            start = info["count"] if info else n
            if kind == "keys":
                keys, approx_keys = block[member], approx[member]
                values = approx_values = other["values"].to(dtype)
            else:
                values, approx_values = block[member], approx[member]
                keys = approx_keys = other["keys"].to(dtype)
            errors.append(
                self.probe.measure(queries.to(dtype), keys, values, approx_keys, approx_values,
                                   exact_k[..., start:, :].to(dtype), exact_v[..., start:, :].to(dtype), self.observer.scaling)
            )
        store.probe_error = torch.stack(errors)
        store.next_share = self.probe.adjust(store.share, store.probe_error, store.probe_state)

    def _apply_probe_shares(self) -> None:
        """After every group has encoded its blocks of this forward: the probes' new budget shares take
        effect together, renormalized to average 1 so the total budget holds."""
        for kind in KINDS:
            stores = [group[kind] for group in self.stores]
            if not any(s.next_share is not None for s in stores):
                continue
            for s in stores:
                if s.next_share is not None:
                    s.share, s.next_share = s.next_share, None
            mean = sum(s.share for s in stores) / len(stores)
            for s in stores:
                s.share /= mean

    def _check_ranks(self, ranks: torch.Tensor, shape: torch.Size) -> None:
        stray = set(torch.unique(ranks).tolist()) - set(self.levels)
        if stray or ranks.shape != shape:
            raise ComponentError(
                f"router '{self.pipeline.use('router')}' returned ranks {sorted(stray)} / shape {tuple(ranks.shape)}; "
                f"expected values in {sorted(self.levels)} shaped {tuple(shape)}"
            )

    # -------------------------------------------------------------------------- reconstruct
    def reconstruct(self, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The stored (packed) tokens of ``layer`` decoded to [B, H, T_packed, D] in ``dtype``."""
        group_index, member = self.group_of[layer]
        store = self.stores[group_index][kind]
        coefficients = self.quantizers[kind].dequantize(store.coefficients.fields, dtype)
        vectors = self.basis.decode(store.state or {}, coefficients, member)
        mixing = self.basis.residual_mixing(len(self.groups[group_index])) if self.residual_levels else None
        if mixing is not None:  # residual rows of the whole group (e.g. depth frequencies)
            members = self.groups[group_index]
            lists = [{rank: r.fields for rank, r in self.windows[other].residuals[kind].items()} for other in members]
            gates = [self.router.gates(other, kind) for other in members]
            bases = [self.windows[other].residual_basis[kind] for other in members]
            vectors = mix_residuals(vectors, member, lists, self.residual_quantizers[kind], mixing, gates, bases)
        elif self.residual_levels:
            lists = {rank: r.fields for rank, r in self.windows[layer].residuals[kind].items()}
            vectors = add_residuals(
                vectors, lists, self.residual_quantizers[kind], self.router.gates(layer, kind), self.windows[layer].residual_basis[kind]
            )
        return vectors

    def prepare_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor | None:
        """Called by the observing attention before ``layer``'s attention; the mask over what ``update``
        returned (see :meth:`kvweave.engine.eviction.Eviction.prepare_attention`)."""
        return self.eviction.prepare_attention(layer, query, key, mask, scaling)

    # ---------------------------------------------------------------------------------- views
    def view(self, layer: int) -> LayerView:
        """``layer``'s packed storage, typed and read-only (:class:`kvweave.core.view.LayerView`)."""
        if not 0 <= layer < self.shape.num_layers:
            raise CacheStateError(f"layer index {layer} is outside the cache's {self.shape.num_layers} layers")
        group_index, member = self.group_of[layer]
        window = self.windows[layer]
        shared = self.basis.coefficient_rows(len(self.groups[group_index])) == 1
        stores = self.stores[group_index]
        exact = window.exact["keys"]
        rows = 0 if exact is None else exact.shape[0] * exact.shape[1]
        kinds = {}
        for kind in KINDS:
            store = stores[kind]
            state = store.state or {}
            levels = []
            for rank in self.residual_levels:
                lists = window.residuals[kind][rank]
                start = mask = None
                if not self.kernel.materializes and exact is not None:
                    start, mask = lists.tile_index(rows, window.compressed_tokens // TILE_TOKENS, exact.device)
                levels.append(ResidualLevelView(rank, lists.fields, start, mask))
            factored = self.basis.factor_bases(store.state, member) if store.state else None
            kinds[kind] = KindView(
                kind=kind,
                coefficients=store.coefficients.fields,
                coefficient_row=0 if shared else member,
                coefficient_format=self.quantizers[kind].packed_format,
                basis_state=state,
                factor_bases=factored,
                residuals=tuple(levels),
                residual_format=self.residual_quantizers[kind].packed_format,
                residual_basis=window.residual_basis[kind],
                gates=self.router.gates(layer, kind),
                exact=window.exact[kind],
            )
        return LayerView(
            layer=layer, group=group_index, member=member, packed_tokens=window.compressed_tokens,
            passed_tokens=window.passed_tokens, flushes=stores["keys"].flushes, keys=kinds["keys"],
            values=kinds["values"], positions=window.positions, scratch=self.kernel_state,
        )

    # ------------------------------------------------------------------------------ queries
    def seq_length(self, layer: int = 0) -> int:
        """Logical tokens cached for ``layer`` (dropped ones included: positions are derived from it)."""
        window = self.windows[layer]
        return window.passed_tokens + window.exact_tokens

    def memory_breakdown(self) -> dict[str, int]:
        """Stored bytes by part: exact window, coefficients, residuals (positions and indices included),
        basis state, and the observation state of the router and probe (recent queries, token flags)."""
        exact = [t for w in self.windows for t in w.exact.values() if t is not None]
        stores = [store for group in self.stores for store in group.values()]
        return {
            "exact_window": tensor_bytes(exact),
            "coefficients": sum(store.coefficients.nbytes() for store in stores),
            "residuals": sum(r.nbytes() for w in self.windows for lists in w.residuals.values() for r in lists.values())
            + tensor_bytes(b for w in self.windows for b in w.residual_basis.values() if b is not None),
            "basis_state": tensor_bytes(t for store in stores for t in (store.state or {}).values()),
            "observation": self.observer.nbytes() + (0 if self.padding is None else tensor_bytes([self.padding])),
            # evicting routers: the cache index of every stored slot, and accumulated attention (H2O)
            "eviction": tensor_bytes(t for w in self.windows for t in (w.positions, w.scores) if t is not None),
        }

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def batch_size(self) -> int:
        tensor = self.windows[0].exact["keys"]
        return -1 if tensor is None else tensor.shape[0]

    # ---------------------------------------------------------------------------- batch ops
    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` [B'] (reordering and repeats allowed) of every stored tensor."""
        for window in self.windows:
            for kind in KINDS:
                if window.exact[kind] is not None:
                    window.exact[kind] = window.exact[kind].index_select(0, index.to(window.exact[kind].device))
                for residuals in window.residuals[kind].values():
                    residuals.select_batch(index, self.shape.num_kv_heads)
                if window.residual_basis[kind] is not None:
                    window.residual_basis[kind] = window.residual_basis[kind].index_select(0, index.to(window.residual_basis[kind].device))
            if window.positions is not None:
                window.positions = window.positions.index_select(0, index.to(window.positions.device))
            if window.scores is not None:
                window.scores = window.scores.index_select(0, index.to(window.scores.device))
        for group in self.stores:
            for store in group.values():
                store.coefficients.map(lambda tensor: tensor.index_select(1, index.to(tensor.device)))
                if store.state:
                    store.state = {name: t.index_select(0, index.to(t.device)) for name, t in store.state.items()}
                store.route_state.update({
                    name: t.index_select(0, index.to(t.device))
                    for name, t in store.route_state.items() if isinstance(t, torch.Tensor)
                })
        self.observer.select_batch(index)
        self.kernel_state = {}
        if self.padding is not None:
            self.padding = self.padding.index_select(0, index.to(self.padding.device))

    def reset(self) -> None:
        self.windows = [LayerWindow(self.levels) for _ in range(self.shape.num_layers)]
        self.stores = [{kind: GroupStore() for kind in KINDS} for _ in self.groups]
        self.pending = set()
        self.returned_keys = {}
        self.padding = None
        self._flush_info = None
        self.kernel_state = {}
        self.observer.reset()
