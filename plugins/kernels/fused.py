"""``fused``: decode attention read straight from the packed cache (coefficients x bases, routed int4
residuals, the exact window), by the Triton kernel of :mod:`kvweave.kernels.depthweave_decode`.

The cache's ``update`` then returns only the exact window for one-token forwards, and kvweave's
attention (``kvweave-observe``) calls :meth:`FusedKernel.attend` with the layer's
:class:`~kvweave.core.view.LayerView` instead of sdpa: no key or value of the packed tokens is
reconstructed. Forwards of several tokens (the prompt) run the model's usual sdpa attention over
reconstructed K/V. The kernel reads nothing but the view; what it derives from it (segment tables, gates
on the device, the last masks) it keeps in ``view.scratch``.

What it reads, by declared packed format (:mod:`kvweave.kernels.formats`): coefficients packed as
``int8-block.v1`` and residual coordinates packed as ``int4-group.v1``. Refused when the pipeline is
resolved (an error naming the kernel's slot and the other one): ``compress = false``, a basis without
``factor_bases`` (``sketch-ema`` has them), other packed formats, keys and values packed differently, an
evictor that drops tokens, ``block_tokens`` not a multiple of 32, residuals not in
``residual_mode = "basis"``, more than three residual rank levels. Refused when the cache is built
(needs the model): head_dim not 64, 128 or 256, a coefficient rank above 64, depth-mixed residual rows.

``backend``: ``auto`` runs the Triton kernel on CUDA tensors and the kernel's torch twin (the same
coefficient-space computation, :func:`~kvweave.kernels.decode_torch.torch_decode`) elsewhere;
``triton`` and ``torch`` force one (``triton`` on a CPU needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.interfaces import KINDS, AttentionKernel, BasisBuilder, PipelineSlots
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer
from kvweave.core.view import KindView, LayerView, ResidualLevelView
from kvweave.kernels.decode_torch import torch_decode, torch_packed_logsumexp
from kvweave.kernels.decode_view import MAX_LEVELS, TILE, DecodeView, ResidualLevel, choose_split, placeholder
from kvweave.kernels.depthweave_decode import COMBINE, COMBINES, VARIANTS, fused_decode, fused_packed_logsumexp
from kvweave.kernels.formats import INT4_GROUP, INT8_BLOCK, int4_group_width
from kvweave.kernels import tiles_tail

BACKENDS = ("auto", "triton", "torch")
HEAD_DIMS = (64, 128, 256)
#: the registered quantizer that writes each packed format the kernel reads (what an error suggests)
WRITERS = {INT8_BLOCK: "int8-block", INT4_GROUP: "int4-group"}


@attrs.frozen
class FusedKernel(AttentionKernel):
    """Attend over int8 coefficients, int4 residuals and the exact window without reconstructing K/V."""

    head_sharding: ClassVar[str] = "head-local"

    materializes: ClassVar[bool] = False
    reads_window_fill: ClassVar[bool] = True
    coefficient_formats: ClassVar[tuple[str, ...]] = (INT8_BLOCK,)
    residual_formats: ClassVar[tuple[str, ...]] = (INT4_GROUP,)

    backend: str = attrs.field(default="auto", validator=choice(BACKENDS), metadata={"doc": "'auto' (Triton on CUDA, the torch twin elsewhere), 'triton' or 'torch'"})
    split_tokens: int = attrs.field(default=0, validator=integer(0), metadata={"doc": "packed tokens per kernel program (a multiple of 32); 0 chooses enough programs to fill the GPU"})
    variant: str = attrs.field(default="auto", validator=choice(VARIANTS), metadata={"doc": "the Triton packed-token pass: 'tiles' (token-major, a residual entry read as two words), 'gather' (one warp, residual coordinates gathered one by one) or 'auto' ('tiles' where the residual layout allows it)"})
    combine: str = attrs.field(default=COMBINE, validator=choice(COMBINES), metadata={"doc": "the Triton combine pass: 'two-pass' (a query head's partials read twice, their maxima first) or 'one-pass' (a slice of the columns a program, every partial in one step)"})

    @split_tokens.validator
    def _tile_multiple(self, attribute, value) -> None:
        if value % TILE:
            raise ValueError(f"'split_tokens' must be a multiple of {TILE} (0 = automatic), got {value}")

    # ---------------------------------------------------------------------------------- checks
    def check_pipeline(self, pipeline: PipelineSlots, slot: str) -> None:
        """What needs no model: the settings, the basis's kind, the packed formats, eviction, the levels."""
        where = f"pipeline '{pipeline.name}': slot '{slot}' ('{pipeline.use(slot)}')"
        settings = pipeline.settings
        if not settings.compress:
            raise ComponentError(f"{where} reads packed storage, but the pipeline stores nothing packed (compress = false); use kernel 'reference'")
        if not _factors(pipeline.component("basis")):
            raise ComponentError(
                f"{where} attends with coefficients times bases, but slot 'basis' ('{pipeline.use('basis')}') does not store "
                "them (no factor_bases); use kernel 'reference', or a basis such as 'sketch-ema'"
            )
        self._check_formats(pipeline, where, "quantizer", "coefficients", self.coefficient_formats)
        if "evictor" in pipeline.slots and getattr(pipeline.component("evictor"), "evicts", False):
            raise ComponentError(
                f"{where} attends over every stored slot, but slot 'evictor' ('{pipeline.use('evictor')}') evicts tokens; "
                "use kernel 'reference', or evictor 'none'"
            )
        if settings.block_tokens % TILE:
            raise ComponentError(f"{where} reads tiles of {TILE} tokens: block_tokens {settings.block_tokens} must be a multiple of {TILE}")
        ranks = tuple(rank for rank in pipeline.component("router").levels() if rank > 0)
        if not ranks:
            return
        if settings.residual_mode != "basis":
            raise ComponentError(
                f"{where} reads residuals stored in residual_mode = \"basis\" (coordinates on a residual basis), "
                f"not {settings.residual_mode!r}; set it, or use kernel 'reference'"
            )
        self._check_formats(pipeline, where, "residual_quantizer", "residuals", self.residual_formats)
        if len(ranks) > MAX_LEVELS:
            raise ComponentError(
                f"{where} takes at most {MAX_LEVELS} residual rank levels, but slot 'router' ('{pipeline.use('router')}') "
                f"has {len(ranks)}: {ranks}; use kernel 'reference'"
            )

    @staticmethod
    def _check_formats(pipeline: PipelineSlots, where: str, slot: str, what: str, formats: tuple[str, ...]) -> None:
        """Refuse ``slot``'s quantizers (the keys' and the values') unless they pack one of ``formats``, the
        same way for both kinds."""
        packers = {}
        for kind in KINDS:
            quantizer = pipeline.component_for(slot, kind)
            if slot == "quantizer":
                quantizer = quantizer.for_kind(kind)  # type: ignore[attr-defined]
            name = _slot_for(pipeline, slot, kind)
            packed = quantizer.packed_format  # type: ignore[attr-defined]
            if packed not in formats:
                writers = " or ".join(f"'{WRITERS[f]}'" for f in formats if f in WRITERS)
                raise ComponentError(
                    f"{where} reads {what} packed as {' or '.join(formats)}, but slot '{name}' ('{pipeline.use(name)}') "
                    f"packs {packed}; use kernel 'reference'" + (f" or {slot} {writers}" if writers else "")
                )
            packers[kind] = (name, quantizer)
        (k_slot, k_quantizer), (v_slot, v_quantizer) = packers["keys"], packers["values"]
        if k_quantizer != v_quantizer:
            raise ComponentError(
                f"{where} reads the {what} of keys and values with one layout, but slot '{k_slot}' ('{pipeline.use(k_slot)}') "
                f"and slot '{v_slot}' ('{pipeline.use(v_slot)}') pack them differently ({k_quantizer} vs {v_quantizer}); "
                "use one quantizer for both, or kernel 'reference'"
            )

    def check_engine(self, engine: Any) -> None:
        """What needs the model: head_dim, the coefficient rank, residual mixing over the basis groups; and,
        until eviction lives only in the ``evictor`` slot, the engine's own eviction flags."""
        pipeline = engine.pipeline
        where = f"pipeline '{pipeline.name}': slot 'kernel' ('{pipeline.use('kernel')}')"
        shape = engine.shape
        if shape.head_dim not in HEAD_DIMS:
            raise ModelError(f"{where} takes head_dim {HEAD_DIMS}; this model's head_dim {shape.head_dim} is not one of them; use kernel 'reference'")
        rank = engine.basis.coefficient_width(shape)
        if rank > 64:
            raise ComponentError(
                f"{where} reads coefficients of rank up to 64, but slot 'basis' ('{pipeline.use('basis')}') gives rank {rank} "
                "on this model: the coefficient rank is above the kernel's 64"
            )
        if engine.evicts or engine.accumulates:
            raise ComponentError(f"{where}: the pipeline evicts tokens or accumulates attention; use kernel 'reference'")
        if engine.residual_levels and any(engine.basis.residual_mixing(len(group)) is not None for group in engine.groups):
            raise ComponentError(
                f"{where} reads each layer's own residuals, but slot 'basis' ('{pipeline.use('basis')}') mixes residual rows "
                "across layers; use kernel 'reference'"
            )

    # ---------------------------------------------------------------------------------- views
    def decode_view(self, view: LayerView, device: torch.device) -> DecodeView:
        """The packed storage of one layer as the kernel reads it: views of ``view``'s tensors, plus the
        segment table and the gates on ``device``, kept in ``view.scratch`` until the storage changes; a window kept
        for a CUDA graph is read to its length on the device (``view.window_fill``)."""
        exact_k, exact_v = view.keys.exact, view.values.exact
        if exact_k is None or exact_v is None:
            raise CacheStateError(f"layer {view.layer}: the cache holds nothing for this layer yet")
        batch, heads = exact_k.shape[:2]
        tokens = view.packed_tokens
        if tokens == 0:
            empty = exact_k.new_zeros(0)
            return DecodeView(0, empty, empty, empty, empty, empty, empty, torch.zeros(0, 3, dtype=torch.int32, device=device),
                              (), (), None, None, None, None, exact_k, exact_v, view.window_fill)
        if view.key_space != "post-rope":
            raise CacheStateError(
                f"layer {view.layer}: keys are stored in key_space {view.key_space!r}; the fused kernel reads keys stored "
                "after the rotary embedding ('post-rope')"
            )
        for kind_view in (view.keys, view.values):
            self._check_kind(view.layer, kind_view)
        row = view.keys.coefficient_row
        k_fields, v_fields = view.keys.coefficients, view.values.coefficients
        segments = self._segments(view, batch, heads, device)
        groups = _residual_groups(view)
        k_levels = tuple(_level(level, groups[level.rank], device) for level in view.keys.residuals)
        v_levels = tuple(_level(level, groups[level.rank], device) for level in view.values.residuals)
        gates = {kind: _on(view.scratch, ("gates", view.layer, kind), view.kind(kind).gates, device) for kind in KINDS}
        return DecodeView(
            packed_tokens=tokens,
            k_codes=k_fields["codes"][row], k_scales=k_fields["scales"][row],
            v_codes=v_fields["codes"][row], v_scales=v_fields["scales"][row],
            k_bases=view.keys.factor_bases[0], v_bases=view.values.factor_bases[0], segments=segments,  # type: ignore[index]
            k_levels=k_levels, v_levels=v_levels,
            k_residual_basis=view.keys.residual_basis, v_residual_basis=view.values.residual_basis,
            k_gates=gates["keys"], v_gates=gates["values"], exact_k=exact_k, exact_v=exact_v, exact_fill=view.window_fill,
        )

    def prepare(self, view: LayerView, device: torch.device) -> None:
        """The segment table and the gates of ``view``'s packed storage, made now (they read the device once per
        storage state; a CUDA graph's capture must find them made)."""
        if view.packed_tokens:
            self.decode_view(view, device)

    def _check_kind(self, layer: int, kind_view: KindView) -> None:
        """Refuse storage the kernel cannot read: packed formats it does not read (a pipeline that was not
        resolved), a basis state without bases."""
        if kind_view.coefficient_format not in self.coefficient_formats:
            raise CacheStateError(
                f"layer {layer}: the {kind_view.kind}' coefficients are packed as {kind_view.coefficient_format}; "
                f"the fused kernel reads {' or '.join(self.coefficient_formats)}"
            )
        if kind_view.residuals and kind_view.residual_format not in self.residual_formats:
            raise CacheStateError(
                f"layer {layer}: the {kind_view.kind}' residuals are packed as {kind_view.residual_format}; "
                f"the fused kernel reads {' or '.join(self.residual_formats)}"
            )
        if kind_view.factor_bases is None:
            raise CacheStateError(f"layer {layer}: basis state of the {kind_view.kind} has no bases to attend with")

    def _segments(self, view: LayerView, batch: int, heads: int, device: torch.device) -> torch.Tensor:
        """The segment table int32 [S, 3] of ``view``'s basis group (cached in ``view.scratch`` until the
        group flushes again or the batch changes)."""
        tokens = view.packed_tokens
        key = ("segments", view.group)
        cached = view.scratch.get(key)
        stamp = (view.flushes, tokens, batch)
        if cached is None or cached[0] != stamp:
            counts = [int(c) for c in view.keys.factor_bases[1].tolist()]  # type: ignore[index]
            if counts != [int(c) for c in view.values.factor_bases[1].tolist()] or sum(counts) != tokens:  # type: ignore[index]
                raise CacheStateError(f"layer {view.layer}: key and value bases cover different tokens ({counts})")
            split = self.split_tokens or choose_split(tokens, batch * heads)
            # each row's last wave of segments shorter where KVWEAVE_TILES_TAIL asks (off by default, until timed)
            cached = (stamp, tiles_tail.tail_segments(counts, split, batch * heads, None, device))
            view.scratch[key] = cached
        return cached[1]

    # ---------------------------------------------------------------------------------- attention
    def attend(self, view: LayerView, query: torch.Tensor, attention_mask: Any, scaling: float) -> torch.Tensor:
        """``query`` [B, Hq, 1, D] over ``view``'s packed tokens and exact window -> [B, 1, Hq, D]."""
        if query.shape[-2] != 1:
            raise CacheStateError(f"the fused kernel decodes one token per sequence; layer {view.layer} got {query.shape[-2]}")
        decode = self.decode_view(view, query.device)
        start = first_positions(view.scratch, attention_mask, query.device)
        q = query[:, :, 0, :]
        out = fused_decode(decode, q, start, scaling, variant=self.variant, combine=self.combine) if self._triton(query) else torch_decode(decode, q, start, scaling)
        return out.unsqueeze(1)  # [B, 1, Hq, D], as the model's attention returns it

    def packed_logsumexp(self, view: LayerView, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """log-sum-exp over ``view``'s packed tokens of ``queries`` [B, Hq, o, D] (times ``scaling``):
        float32 [B, Hq, o], read from the packed storage. The engine's attention statistics use it at a
        flush, so routing never reconstructs a layer's keys either."""
        batch, q_heads, observed, dim = queries.shape
        decode = self.decode_view(view, queries.device)
        flat = queries.reshape(batch, q_heads * observed, dim)
        if self._triton(queries):
            lse = fused_packed_logsumexp(decode, flat, scaling, variant=self.variant)
        else:
            lse = torch_packed_logsumexp(decode, flat, scaling)
        return lse.reshape(batch, q_heads, observed)

    def _triton(self, tensor: torch.Tensor) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and tensor.is_cuda)


def _factors(basis: Any) -> bool:
    """Whether ``basis`` decodes as coefficients times bases (its class overrides ``factor_bases``)."""
    return type(basis).factor_bases is not BasisBuilder.factor_bases


def _slot_for(pipeline: PipelineSlots, slot: str, kind: str) -> str:
    """The slot ``kind`` takes ``slot`` from: its own (``keys.quantizer``) when the pipeline names one."""
    own = f"{kind}.{slot}"
    return own if own in pipeline.slots else slot  # type: ignore[attr-defined]


def _residual_groups(view: LayerView) -> dict[int, int]:
    """int4 channels per scale at each residual rank, from the packed fields' widths (``q_packed``
    [N, rank / 2], ``q_scales`` [N, rank / group]; the quantizer uses ``min(group, rank)``).

    A level that holds no fields yet gets what the others imply: the quantizer's ``group`` where a level
    shows it (fewer channels per scale than its rank), else one scale per entry. The kernel reads none of
    its bytes, so this only keeps the kernel's compiled variant the one the filled level will use."""
    seen: dict[int, int] = {}
    for kind_view in (view.keys, view.values):
        for level in kind_view.residuals:
            fields = level.fields
            if level.rank not in seen and "q_packed" in fields and "q_scales" in fields:
                seen[level.rank] = int4_group_width(fields["q_packed"], fields["q_scales"])
    shown = [group for rank, group in seen.items() if group < rank]
    groups = dict(seen)
    for kind_view in (view.keys, view.values):
        for level in kind_view.residuals:
            groups.setdefault(level.rank, min(shown[0], level.rank) if shown else level.rank)
    return groups


def _level(level: ResidualLevelView, group: int, device: torch.device) -> ResidualLevel:
    """The kernel's :class:`ResidualLevel` of one :class:`ResidualLevelView`
    (placeholders for a level without entries)."""
    if level.tile_start is None or level.tile_mask is None:
        raise CacheStateError(f"residual level {level.rank} has no tile index (the engine builds it for kernels that read in place)")
    if level.entries:
        f = level.fields
        return ResidualLevel(level.rank, group, level.entries, f["q_packed"], f["q_scales"], level.tile_start,
                             level.tile_mask, level.located)
    return ResidualLevel(level.rank, group, 0, placeholder(device, torch.uint8), placeholder(device, torch.float16),
                         level.tile_start, level.tile_mask)


def _on(scratch: dict, key: tuple, tensor: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    """``tensor`` as float32 on ``device``, copied once and kept in ``scratch`` under ``key`` (None stays None)."""
    if tensor is None:
        return None
    cached = scratch.get(key)
    if cached is None or cached.device != device:
        cached = tensor.to(device=device, dtype=torch.float32).contiguous()
        scratch[key] = cached
    return cached


def first_positions(scratch: dict, attention_mask: Any, device: torch.device) -> torch.Tensor | None:
    """The first logical position each row attends to, int32 [B], from the model's mask for a one-token
    forward (None: no mask). A mask may hide a prefix only (left padding, a sliding window); one that hides a
    token after a visible one is refused. Computed once per mask: a forward passes one mask per layer type
    (full and sliding layers alternate), so the last two are kept in ``scratch`` (a layer view's)."""
    if attention_mask is None:
        return None
    recent = scratch.setdefault("masks", [])
    for mask, start in recent:
        if mask is attention_mask:
            return start
    mask = attention_mask[:, 0, -1, :]  # [B, kv]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    first = torch.where(allowed, positions, allowed.shape[-1]).amin(dim=-1)
    if not bool((allowed == (positions[None, :] >= first[:, None])).all()):
        raise CacheStateError(
            "the fused kernel takes masks that hide a prefix only (left padding, sliding windows); this attention "
            "mask hides a token after a visible one"
        )
    start = first.to(device=device, dtype=torch.int32)
    recent[:] = [*recent[-1:], (attention_mask, start)]
    return start


@hookimpl
def kvweave_register_kernels(registrar) -> None:
    registrar.add("fused", FusedKernel)
