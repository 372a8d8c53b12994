"""The compression engine behind :class:`kvweave.engine.cache.KVWeaveCache`.

Per layer, new tokens enter an exact window (model dtype). Once every layer of a basis group holds ``recent_window +
block_tokens`` exact tokens, the oldest whole blocks leave the window: the basis encodes them to coefficients ``[S, B,
H, n, r]``, the quantizer packs those, the router gives every token a residual rank, and a token at rank ``rho > 0``
keeps the ``rho`` largest channels of what the packed coefficients miss (:mod:`kvweave.engine.residuals`). The exact
copies are then dropped, so the memory is really freed.

``update`` returns the K/V the model attends over: the stored blocks reconstructed, then the exact window (the reference
path). Tokens are compressed after the forward pass that added them, so a prompt attends to itself exactly during
prefill and compressed afterwards.

Budget: when the router has a ``target_reduction``, each group's K (and V) storage is held to its share of ``16-bit
bytes / target_reduction`` for the tokens cached so far, counting its coefficients, basis state, residuals and its
layers' exact windows; the residuals of a block get what is left, and the probe moves budget between groups (shares stay
1 on average). See docs/depthweave.md.

Eviction (a pipeline whose ``evictor`` slot drops tokens) is the engine's collaborator
:class:`kvweave.engine.eviction.Eviction`; the stored state is in :mod:`kvweave.engine.store`. Keys and values may take
different quantizers (``keys.quantizer`` / ``values.quantizer`` slots).
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.core.deferred import DeferredChecks
from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.evictor import Evictor
from kvweave.core.interfaces import KINDS, AttentionKernel, BasisBuilder, ModelShape, Probe, Quantizer, Router
from kvweave.core.precision import float32_products
from kvweave.core.registry import ResolvedPipeline
from kvweave.core.view import LayerView
from kvweave.engine.accounting import memory_breakdown
from kvweave.engine.budget import BudgetPlan
from kvweave.engine.checks import check_block_groups, check_widths
from kvweave.engine.decode import block_attention_stats, reconstruct
from kvweave.engine.encoder import BlockEncoder
from kvweave.engine.energy import QueryEnergy, weighs_by_energy
from kvweave.engine.eviction import Eviction
from kvweave.engine.observation import ATTENTION_NAME, Observer
from kvweave.engine.overlap import FlushOverlap
from kvweave.engine.quantizers import group_quantizers
from kvweave.engine.flushing import flush_block, flushed
from kvweave.engine.rotary import RotaryInverse, turn_keys
from kvweave.engine.rows import RowSplit, left_padding
from kvweave.engine.sliding import check_compress_sliding, kept_tokens, slide, split_sliding
from kvweave.engine.store import GroupStore, LayerWindow, select_rows
from kvweave.engine.views import layer_view


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
        for slot in pipeline.slots:
            pipeline.component(slot).check_model(shape)
        #: ``{layer: window}`` of the sliding-window layers (engine/sliding.py)
        self.sliding = shape.sliding_layers
        #: sliding_layers = "compress": sliding-window layers are compressed too and drop the blocks their window left
        self.compress_sliding = bool(self.sliding) and self.settings.sliding_layers == "compress"
        #: ``{layer: tokens}`` a sliding-window layer keeps (its window - 1, or the ``sliding_tokens`` setting)
        self.sliding_keep = kept_tokens(self.sliding, self.settings.sliding_tokens, f"pipeline '{pipeline.name}'")
        #: ``{layer: tokens}`` of the sliding-window layers kept uncompressed, as the model's own cache keeps them
        self.kept_exact: dict[int, int] = {} if self.compress_sliding else self.sliding_keep
        self.groups = split_sliding(self.basis.layer_groups(shape), self.sliding, together=self.compress_sliding)
        self.group_of = self._index_groups()
        #: the last group that compresses: its flush ends a forward's flushes
        self.last_flushing = max((g for g, members in enumerate(self.groups) if members[0] not in self.kept_exact), default=-1)
        where = f"pipeline '{pipeline.name}'"
        #: per basis group and kind: the quantizer of its layers (``Quantizer.for_layer``: a per-layer table)
        self.group_quantizers = group_quantizers(pipeline, self.quantizers, self.groups, where)
        self.levels = tuple(self.router.levels())
        check_widths(self, where)
        #: keys stored before the rotary embedding (engine/rotary.py); the rotary inverse comes with the model
        self.pre_rope = self.settings.key_space == "pre-rope"
        self.rotary: RotaryInverse | None = None
        self.evicts = bool(self.evictor.evicts)
        self.residual_levels = tuple(rank for rank in self.levels if rank > 0)
        self.accumulates = self.evicts and bool(self.evictor.accumulates)
        self.reselects = self.evicts and bool(self.evictor.reselects)
        self.eviction = Eviction(self, self.evictor)
        self.encoder = BlockEncoder(self)
        self.deferred = DeferredChecks()  # a forward's flushes' checks, read once (core/deferred.py)
        self.overlap = FlushOverlap(self)  # a prompt's flushes behind its forward on a GPU (engine/overlap.py)
        self.defer_checks: bool | None = None  # None: on a GPU; True / False: always / never
        if self.evicts:
            self.eviction.check(where)
        if self.compress_sliding:
            check_compress_sliding(self, where)
        check_block_groups(self, where)
        self.budget = BudgetPlan.for_engine(self)  # raises BudgetError when the target cannot be met
        observes = self.router.needs_attention or self.probe.needs_queries or (self.evicts and self.evictor.needs_attention)
        self.observer = Observer(shape, pipeline.settings.observe_queries if observes else 0)
        #: per-channel query energy, for a keys quantizer that weighs its channels by it (engine/energy.py)
        self.energy = QueryEnergy(shape.num_layers) if weighs_by_energy(pipeline, self.basis, self.group_quantizers, where) else None
        if self.probe.selects_queries:
            self.observer.selector = self.probe.select_queries
        self.boundary_ids: torch.Tensor | None = None
        #: the model's attention must report to this cache (queries, masks of evicted tokens, attention)
        self.own_attention = self.observer.active or self.evicts or self.accumulates or not self.kernel.materializes or self.energy is not None
        self.forward_tokens = 0  # tokens of the forward pass in progress
        #: the model's 2-D attention mask of the forward in progress (set by bind_model's hook)
        self.mask_tap: Any = None
        self.reset()
        self.kernel.check_engine(self)

    def quantizer(self, group_index: int, kind: str) -> Quantizer:
        """The quantizer of ``kind`` for the layers of basis group ``group_index``."""
        return self.group_quantizers[group_index][kind]

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

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, materialize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Append ``keys``/``values`` [B, H, q, D] to ``layer``; return its full K/V [B, H, T, D] (None with
        ``materialize=False``: filling a cache without attention, e.g. :mod:`kvweave.engine.synthetic`). Where checks
        are deferred (a GPU), those of the forward's updates and flushes read the host once: after its last flush, or
        after the last layer's update when that layer flushes nothing."""
        with self.deferred.collecting(self._defers(keys.device)):
            out = self._update(layer, keys, values, materialize)
        if layer == self.shape.num_layers - 1 and self.group_of[layer][0] not in self.pending:
            self.deferred.resolve()
        return out

    def _defers(self, device: torch.device | None) -> bool:
        """Whether checks wait for the forward's end (:mod:`kvweave.core.deferred`): on a GPU, unless ``defer_checks``
        says otherwise."""
        return self.defer_checks if self.defer_checks is not None else getattr(device, "type", None) == "cuda"

    def _update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, materialize: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if not 0 <= layer < self.shape.num_layers:
            raise CacheStateError(f"layer index {layer} is outside the cache's {self.shape.num_layers} layers")
        if keys.shape[1] != self.shape.num_kv_heads or keys.shape[-1] != self.shape.head_dim:
            raise ModelError(
                f"layer {layer} sent keys shaped {tuple(keys.shape)}; the cache was built for "
                f"{self.shape.num_kv_heads} KV heads of dim {self.shape.head_dim}" + (
                    "; the model computes a share of its heads per tensor-parallel rank: build the cache with "
                    "build_cache(pipeline, model), which reads the model's sharding" if self.shape.num_kv_heads % keys.shape[1] == 0 else "")
            )
        if layer == 0 and self.rows is None and self._splits_rows(keys):
            if self.eviction.context.scores is not None:
                raise CacheStateError(
                    f"pipeline '{self.pipeline.name}': context importance is scored for whole rows; a left-padded batch is "
                    "stored row by row (feed its rows one at a time)")
            pads = left_padding(self.mask_tap.pending)  # type: ignore[union-attr,arg-type]
            self.rows = RowSplit(self, pads, lambda: CompressionEngine(self.pipeline, self.shape))  # type: ignore[arg-type]
        if self.rows is not None:
            return self.rows.update(layer, keys, values, materialize)
        if layer == 0:
            self.overlap.start_forward(keys, materialize)  # flushes an interrupted forward left queued go first
            self.deferred.resolve()  # a check left by a forward whose last group did not flush
            self.observer.start_forward(keys.shape[-2], self.windows[0].exact.fill)
            self.forward_tokens = keys.shape[-2]
            if self.evicts:
                self.eviction.context.start_forward(keys.shape[-2], keys.shape[0])
        if self.pending and self.group_of[layer][0] in self.pending:
            raise CacheStateError(
                f"pipeline '{self.pipeline.name}' needs the model's attention to report to the cache (recent queries, "
                f"the mask of evicted tokens), but the model's attention did not report them; build the cache with build_cache(pipeline, model) so "
                f"the model uses '{ATTENTION_NAME}' attention"
            )
        window = self.windows[layer]
        if self.reads_in_place(keys.shape[-2]) and materialize:  # the kernel reads the packed tokens itself
            full = tuple(window.exact.append_read(kind, new) for kind, new in zip(KINDS, (keys, values)))
            if window.exact.lossy:  # the kernel reads the window (its own token as it arrived) from the layer's view
                self.attending[layer] = full
        else:
            empty = window.exact.shape() is None and window.compressed_tokens == 0
            for kind, new in zip(KINDS, (keys, values)):
                window.exact.append(kind, new)
            if not materialize:  # nothing reads the layer's tokens back (an int8 window would decode them all)
                full = (None, None)
            elif window.exact.lossy and empty:  # every token is this forward's own: as they arrived
                full = (keys, values)
            else:
                full = tuple(self._materialize(layer, kind) for kind in KINDS)
            if window.exact.lossy and materialize and not empty:  # this forward attends over its own tokens as they arrived
                for tensor, new in zip(full, (keys, values)):
                    tensor[..., -new.shape[-2]:, :] = new
        if layer in self.kept_exact:  # the model's own attention reads its window
            slide(window, self.kept_exact[layer])
            return full if materialize else None  # type: ignore[return-value]
        if self.own_attention and materialize:
            self.returned_keys[layer] = full[0]  # lets the attention call tell it belongs to this cache
        group_index, member = self.group_of[layer]
        if self.settings.compress and member == len(self.groups[group_index]) - 1:
            if self.own_attention:
                self.pending.add(group_index)  # flushed by after_attention, once the attention has run
            else:
                self.overlap.request(group_index)
        return full if materialize else None  # type: ignore[return-value]

    def _splits_rows(self, keys: torch.Tensor) -> bool:
        """Whether this forward starts per-row storage: an empty cache of a compressing pipeline, a model
        without sliding-window layers, a left-padded batch (the mask of this very forward: as many rows and
        tokens as ``keys``, so a mask left from another call is never taken)."""
        mask = None if self.mask_tap is None else self.mask_tap.pending
        if mask is None or mask.shape[0] < 2 or self.windows[0].exact.shape() is not None:
            return False
        if tuple(mask.shape) != (keys.shape[0], keys.shape[-2]):
            return False
        if not self.settings.compress or self.sliding:
            return False
        return left_padding(mask) is not None

    def reads_in_place(self, new_tokens: int) -> bool:
        """Whether the attention of a forward of ``new_tokens`` tokens goes to the pipeline's kernel, which
        reads the packed storage in place (one-token forwards with a kernel that does not materialize)."""
        return new_tokens == 1 and not self.kernel.materializes

    def owns(self, layer: int, keys: torch.Tensor) -> bool:
        """Whether ``keys`` are what this cache's ``update`` just returned for ``layer``."""
        if self.rows is not None:
            return self.rows.owns(layer, keys)
        return self.returned_keys.get(layer) is keys

    def after_attention(self, layer: int) -> None:
        """Called by the observing attention after ``layer``'s attention: flush its group if it waits."""
        self.returned_keys.pop(layer, None)
        group_index, member = self.group_of[layer]
        if group_index in self.pending and member == len(self.groups[group_index]) - 1:
            self.pending.discard(group_index)
            self.overlap.request(group_index)

    def replace_router(self, router: Router) -> Router:
        """Route with ``router`` from the next flush on (same levels; training swaps in routers that record what they see)."""
        if tuple(router.levels()) != self.levels:
            raise ComponentError(f"pipeline '{self.pipeline.name}': a replacement router must have the levels {self.levels}, not {tuple(router.levels())}")
        previous, self.router = self.router, router
        return previous

    def materialize(self, layer: int, kind: str) -> torch.Tensor:
        self._one_storage("materialize")
        return self._materialize(layer, kind)

    def _materialize(self, layer: int, kind: str) -> torch.Tensor:
        """``layer``'s ``kind`` ("keys"/"values") as the reference path attends over: the packed tokens
        reconstructed, then the exact window, [B, H, T_stored, D] in the model's dtype."""
        exact = self.windows[layer].exact[kind]
        if self.windows[layer].compressed_tokens == 0:
            return exact  # type: ignore[return-value]
        return torch.cat((self.reconstruct(layer, kind, exact.dtype), exact), dim=-2)  # type: ignore[union-attr]

    def _flush(self, group_index: int) -> None:
        """Encode the group's ready block, its float32 products as the pipeline's ``products`` says
        (:func:`kvweave.core.precision.float32_products`). On a GPU (or with ``defer_checks``) its checks read the host
        with the forward's others, after its last flush (:mod:`kvweave.core.deferred`), or before any other error of the
        flush propagates; elsewhere each at once."""
        device = self.windows[self.groups[group_index][0]].exact.device
        with self.deferred.collecting(self._defers(device)), float32_products(self.settings.products):
            self._flush_block(group_index)
        if group_index == self.last_flushing:
            self.deferred.resolve()

    def _flush_block(self, group_index: int) -> None:
        flush_block(self, group_index)

    def _flushed(self, members: tuple[int, ...], count: int, last: bool, group_index: int | None = None) -> None:
        flushed(self, members, count, last, group_index)

    def _attention_stats(self, members: tuple[int, ...], count: int) -> tuple[torch.Tensor, torch.Tensor]:
        return block_attention_stats(self, members, count)

    def reconstruct(self, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The stored (packed) tokens of ``layer`` decoded to [B, H, T_packed, D] in ``dtype``."""
        return reconstruct(self, layer, kind, dtype)

    def rope_keys(self, keys: torch.Tensor, members: tuple[int, ...], positions: torch.Tensor | None, inverse: bool) -> torch.Tensor:
        """Keys [G, B, H, n, D] of the group's layers ``members`` un-rotated (``inverse``) or rotated at cache
        indices ``positions`` (broadcast to [G, B, H, n]); float32 (:func:`kvweave.engine.rotary.turn_keys`)."""
        return turn_keys(self.rotary, f"pipeline '{self.pipeline.name}'", keys, members, positions, inverse)

    def note_padding(self, mask: torch.Tensor | None, batch: int) -> None:
        """Called by the observing attention where the kernel reads in place (no :meth:`prepare_attention`): the
        padding of this forward, for an evictor (see :meth:`kvweave.engine.eviction.Eviction.note_padding`)."""
        if self.evicts or self.accumulates:
            self.eviction.note_padding(mask, batch)

    def prepare_attention(
        self, layer: int, query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor | None, scaling: float | None
    ) -> torch.Tensor | None:
        """Called by the observing attention before ``layer``'s attention; the mask over what ``update``
        returned (see :meth:`kvweave.engine.eviction.Eviction.prepare_attention`)."""
        return self.eviction.prepare_attention(layer, query, key, mask, scaling)

    def view(self, layer: int) -> LayerView:
        """``layer``'s packed storage, typed and read-only (:class:`kvweave.core.view.LayerView`)."""
        self._one_storage("view")
        return layer_view(self, layer)

    def _one_storage(self, what: str) -> None:
        if self.rows is not None:
            raise CacheStateError(
                f"this cache keeps each row of its left-padded batch in an engine of its own; ask row i's engine "
                f"for its {what}: cache.engine.rows.engines[i].{what}(...)"
            )

    def views(self) -> list[LayerView]:
        """Every layer's view, in layer order."""
        self._one_storage("views")
        return [layer_view(self, layer) for layer in range(self.shape.num_layers)]

    def seq_length(self, layer: int = 0) -> int:
        """Logical tokens cached for ``layer`` (dropped ones included: positions are derived from it)."""
        if self.rows is not None:
            return self.rows.seq_length(layer)
        window = self.windows[layer]
        return window.passed_tokens + window.exact_tokens

    def memory_breakdown(self) -> dict[str, int]:
        """Stored bytes by part (:func:`kvweave.engine.accounting.memory_breakdown`)."""
        return self.rows.memory_breakdown() if self.rows is not None else memory_breakdown(self)

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def batch_size(self) -> int:
        if self.rows is not None:
            return len(self.rows.engines)
        shape = self.windows[0].exact.shape()
        return -1 if shape is None else shape[0]

    def select_batch(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` [B'] (reordering and repeats allowed) of every stored tensor."""
        if self.rows is not None:
            self.rows.select(index)
            return
        select_rows(self.windows, self.stores, index, self.shape.num_kv_heads)
        self.attending = {}
        self.observer.select_batch(index)
        if self.energy is not None:
            self.energy.select_batch(index)
        self.kernel_state = {}
        if self.padding is not None:
            self.padding = self.padding.index_select(0, index.to(self.padding.device))

    def _new_window(self) -> LayerWindow:
        # a kernel that reads the packed storage in place reads the slots' cache indices every step: they stay
        # a list for it (bits would be decoded per step); the reference path reads them from the bits
        return LayerWindow(self.levels, self.settings.window_storage, slot_bits=self.kernel.materializes,
                           residual_tiles=self.kernel.builds_residual_tiles)

    def reset(self) -> None:
        """Drop every stored token (the state a new engine starts from)."""
        self.deferred.clear()
        self.overlap.clear()
        self.windows = [self._new_window() for _ in range(self.shape.num_layers)]
        self.stores = [{kind: GroupStore() for kind in KINDS} for _ in self.groups]
        self.pending: set[int] = set()
        self.returned_keys: dict[int, torch.Tensor] = {}
        #: a lossy exact window as this forward attends over it (its own tokens exact), for the layer's view
        self.attending: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        #: what a kernel that reads the packed storage in place keeps between calls (segment tables, ...)
        self.kernel_state: dict = {}
        self.padding: torch.Tensor | None = None  # bool [B, T]: False for padding (from the attention mask)
        self._flush_info: dict | None = None  # the flush in progress, when it evicts
        self._budget_warned = False  # BudgetPlan.check_met warns once per cache
        #: the engines of a left-padded batch's rows once one arrives (engine/rows.py)
        self.rows: RowSplit | None = None
        self.observer.reset()
        self.eviction.context.clear()
        if self.energy is not None:
            self.energy.reset()
