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

Eviction (routers with the ``DROPPED`` level) lives in :mod:`kvweave.engine.eviction`, mixed into the engine.
"""

from __future__ import annotations

import torch

from kvweave.engine.budget import BudgetPlan
from kvweave.engine.eviction import EvictionMixin
from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.interfaces import DROPPED, KINDS, AttentionKernel, BasisBuilder, ModelShape, Probe, Quantizer, RouteBlock, Router
from kvweave.engine.observation import ATTENTION_NAME, Observer
from kvweave.core.registry import ResolvedPipeline
from kvweave.engine.residuals import TILE_TOKENS, ResidualList, add_residuals, encode_residuals, fit_residual_basis, mix_residuals, residual_rows
from kvweave.core.storage import Segment, TensorMap, tensor_bytes


class LayerWindow:
    """One layer's exact (uncompressed) recent tokens, its routed residuals, and its packed-token count."""

    def __init__(self, levels: tuple[int, ...]) -> None:
        self.exact: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self.residuals = {kind: {rank: ResidualList(rank) for rank in levels if rank > 0} for kind in KINDS}
        self.residual_basis: dict[str, torch.Tensor | None] = {kind: None for kind in KINDS}  # [B, H, R, D]
        self.compressed_tokens = 0  # stored (packed) slots per batch row and head
        self.passed_tokens = 0  # logical tokens that left the exact window (stored or dropped)
        # eviction: the cache index (logical position) of each stored slot, -1 for a filler slot
        self.positions: torch.Tensor | None = None  # int32 [B, H, compressed_tokens]
        # routers that accumulate attention: what every query gave each stored slot, then each exact token
        self.scores: torch.Tensor | None = None  # float32 [B, H, compressed_tokens + exact_tokens]

    @property
    def exact_tokens(self) -> int:
        tensor = self.exact["keys"]
        return 0 if tensor is None else tensor.shape[-2]


class GroupStore:
    """Packed coefficients of one basis group for keys or values, plus the basis state they decode with."""

    def __init__(self) -> None:
        self.state: TensorMap | None = None
        self.coefficients = Segment()
        self.flushes = 0
        self.share = 1.0
        self.next_share: float | None = None
        self.probe_state: dict[str, float] = {}
        self.probe_error: torch.Tensor | None = None
        self.route_state: dict = {}  # the router's per-group state (RouteBlock.state; tensors batch-first)


class CompressionEngine(EvictionMixin):
    """Holds every stored tensor of a compressed cache and does the encoding and reconstruction."""

    def __init__(self, pipeline: ResolvedPipeline, shape: ModelShape) -> None:
        self.pipeline = pipeline
        self.shape = shape
        self.settings = pipeline.settings
        self.basis: BasisBuilder = pipeline.component("basis")  # type: ignore[assignment]
        self.quantizer: Quantizer = pipeline.component("quantizer")  # type: ignore[assignment]
        self.router: Router = pipeline.component("router")  # type: ignore[assignment]
        self.residual_quantizer: Quantizer = pipeline.component("residual_quantizer")  # type: ignore[assignment]
        self.probe: Probe = pipeline.component("probe")  # type: ignore[assignment]
        self.kernel: AttentionKernel = pipeline.component("kernel")  # type: ignore[assignment]
        for slot in pipeline.slots:
            pipeline.component(slot).check_model(shape)
        self.groups = self.basis.layer_groups(shape)
        self.group_of = self._index_groups()
        where = f"pipeline '{pipeline.name}'"
        self.quantizer.check_width(self.basis.coefficient_width(shape), f"{where}, slot 'quantizer' (coefficients)")
        self.levels = tuple(self.router.levels())
        for rank in self.levels:
            if rank != DROPPED and (rank > shape.head_dim or rank < 0):
                raise ModelError(f"{where}: router rank level {rank} is outside 0..head_dim ({shape.head_dim}) and not DROPPED ({DROPPED})")
            if rank > 0:
                self.residual_quantizer.check_width(rank, f"{where}, slot 'residual_quantizer' (rank level {rank})")
        self.evicts = DROPPED in self.levels
        self.residual_levels = tuple(rank for rank in self.levels if rank > 0)
        self.accumulates = bool(self.router.accumulates)
        self.reselects = bool(self.router.reselects)
        self._check_eviction(where)
        grouped = self.quantizer.for_kind("keys").tokens_per_group(), self.quantizer.for_kind("values").tokens_per_group()
        for group in grouped:
            if self.settings.block_tokens % group:
                raise ModelError(
                    f"{where}, slot 'quantizer' ('{pipeline.slots['quantizer'].use}'): it packs groups of {group} tokens, "
                    f"which must divide the pipeline's block_tokens ({self.settings.block_tokens})"
                )
        self.budget = BudgetPlan.for_engine(self)  # raises BudgetError when the target cannot be met
        self.observer = Observer(
            shape, pipeline.settings.observe_queries if (self.router.needs_attention or self.probe.needs_queries) else 0
        )
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
        wants_stats = self.router.needs_attention and (self.residual_levels or self.evicts)
        stats = self._attention_stats(members, count) if wants_stats else None
        if self.reselects:
            self._reselect(group_index, count)
        elif self.evicts:
            self._evict(group_index, count, stats)
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
                self._key_valid(layer) if self.evicts else None,
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
        quantizer = self.quantizer.for_kind(kind)
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
            ranks = self.router.assign(self._route_block(kind, group_index, work, miss, stats, approx, rows, mixing))
            self._check_ranks(ranks, work.shape[:-1], allow_dropped=False)
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
                entries[member] = encode_residuals(missing, ranks[member], self.residual_quantizer, basis)
                if mixing is None:
                    approx[member] = add_residuals(approx[member], entries[member], self.residual_quantizer, self.router.gates(layer, kind), basis)
                for rank, fields in entries[member].items():
                    fields["token"] = fields["token"] + self.windows[layer].compressed_tokens
                    self.windows[layer].residuals[kind][rank].append(fields)
            if mixing is not None and self.probe.wants(store.flushes):  # rows of the whole group, mixed per layer
                relative = [{rank: {**f, "token": f["token"] - self.windows[layer].compressed_tokens} for rank, f in e.items()} for e, layer in zip(entries, members)]
                gates = [self.router.gates(layer, kind) for layer in members]
                bases = [self.windows[layer].residual_basis[kind] for layer in members]
                approx = torch.stack([mix_residuals(approx[m], m, relative, self.residual_quantizer, mixing, gates, bases) for m in range(len(members))])
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
            level_bytes=self.budget.level_bytes,
            budget_bytes=self.budget.residual_budget(self, group_index, kind, work.shape[-2], info.get("dropped", 0)),
            attention_mass=mass,
            attention_spike=spike,
            boundary=self.observer.boundaries(first, info.get("count", work.shape[-2])),
            kept_index=info.get("kept_index"),
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

    # -------------------------------------------------------------------------- reconstruct
    def reconstruct(self, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The stored (packed) tokens of ``layer`` decoded to [B, H, T_packed, D] in ``dtype``."""
        group_index, member = self.group_of[layer]
        store = self.stores[group_index][kind]
        coefficients = self.quantizer.for_kind(kind).dequantize(store.coefficients.fields, dtype)
        vectors = self.basis.decode(store.state or {}, coefficients, member)
        mixing = self.basis.residual_mixing(len(self.groups[group_index])) if self.residual_levels else None
        if mixing is not None:  # residual rows of the whole group (e.g. depth frequencies)
            members = self.groups[group_index]
            lists = [{rank: r.fields for rank, r in self.windows[other].residuals[kind].items()} for other in members]
            gates = [self.router.gates(other, kind) for other in members]
            bases = [self.windows[other].residual_basis[kind] for other in members]
            vectors = mix_residuals(vectors, member, lists, self.residual_quantizer, mixing, gates, bases)
        elif self.residual_levels:
            lists = {rank: r.fields for rank, r in self.windows[layer].residuals[kind].items()}
            vectors = add_residuals(
                vectors, lists, self.residual_quantizer, self.router.gates(layer, kind), self.windows[layer].residual_basis[kind]
            )
        return vectors

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
