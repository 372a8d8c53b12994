"""``lowbit``: decode attention read straight from low-bit keys and values (the frontier pipelines of
docs/frontier.md), by the Triton kernel of :mod:`kvweave.kernels.lowbit_decode`.

Keys packed as ``channel-group.v1`` (per channel over token groups, uniform 2-, 3- or 4-bit codes, exact
outliers) and stored before the rotary embedding (``key_space = "pre-rope"``; post-RoPE works too) are
dequantized and rotated at each token's position in registers, from the model's ``inv_freq``; values packed
as ``rotated-token.v1`` (2-, 3- or 4-bit codes per token after a fixed rotation, symmetric, normal or uniform
levels; a per-layer ``layer_bits`` table too) are summed in the rotated space and rotated back once per query. Nothing is reconstructed in memory:
the cache's ``update`` returns only the exact window for one-token forwards, and kvweave's attention calls
:meth:`LowbitKernel.attend` with the layer's view. Prompts (several tokens) run the model's sdpa over
reconstructed K/V, as with every kernel.

Keys packed as ``channel-alloc.v1`` (each token group's bits spread over its channels) are read the same
way, each channel at its own width and offset in the token's stream (two bytes a code, general kernel).
Values packed as ``rotated-token-log8.v1`` (one-byte scales) are read in place too: each scale is made in
registers from its byte and its ``scale_tokens`` tokens' float16 maximum.

A cache that dropped tokens (an evictor that neither accumulates attention nor re-selects, e.g. ``kvzip``) is
read at each slot's cache index: the keys rotated at it, filler slots never attended; the query must then see
every held token (no padding mask).

Refused when the pipeline is resolved, naming the slot: ``compress = false``, a basis other than
``identity``, residual rank levels, an evictor that accumulates attention or re-selects, other packed formats,
non-uniform key levels, asymmetric values. The ``wide`` kernel reads every storage whose values come in at most four
channel groups (2/4-bit codes unpacked in registers, 3-bit and ``channel-alloc`` codes read from their bytes), the
general one the rest. Refused when the cache is built: head_dim not 64, 128 or 256, a
rotary embedding whose angles are not ``position * inv_freq``.

``backend``: ``auto`` runs the Triton kernel on CUDA tensors and its torch twin elsewhere; ``triton`` and
``torch`` force one (``triton`` on a CPU needs ``TRITON_INTERPRET=1``). ``tricks``: conversions the Triton kernel
leaves out ("+"-separated names of :data:`kvweave.kernels.lowbit_tricks.TRICKS`; none by default): unknown names are
refused when the pipeline is resolved, a trick the layer's launch cannot take (``vb16``/``ktf32`` without a GPU's
bfloat16 operands, ``kfold`` on keys stored before RoPE, anything but ``magic`` on the general kernel) when the layer
first decodes, naming the layer. The torch twin has no conversions to leave out and computes as without them.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.interfaces import AttentionKernel, PipelineSlots
from kvweave.core.lazy import torch
from kvweave.core.params import choice
from kvweave.core.view import LayerView
from kvweave.kernels.formats import CHANNEL_ALLOC, CHANNEL_GROUP, LOG8_VALUE_FORMATS, TILED_VALUE_FORMATS, VALUE_FORMATS, VALUE_TILE
from kvweave.kernels.lowbit_decode import (
    LowbitView, level_kind, lowbit_decode, resolve_variant, rope_at, slot_positions, tile_rows, torch_keys, torch_lowbit_decode,
    torch_values,
)
from kvweave.kernels.lowbit_dense import tiles_build_refusal
from kvweave.kernels.lowbit_tricks import TRICKS, parse_tricks

from .fused import first_positions

BACKENDS = ("auto", "triton", "torch")


def _trick_names(_instance: Any, _attribute: Any, value: Any) -> None:
    """``tricks``: a string of "+"-separated :data:`TRICKS`, each at most once ("" for none)."""
    if not isinstance(value, str):
        raise TypeError(f"'tricks' must be a string of '+'-separated names of {', '.join(TRICKS)}; got {value!r}")
    names = [t for t in value.split("+") if t]
    unknown = [t for t in names if t not in TRICKS]
    if unknown or len(set(names)) != len(names) or ("kfold" in names and "ktf32" in names):
        raise ValueError(f"'tricks' must be '+'-separated names of {', '.join(TRICKS)}, each once, not both 'kfold' and "
                         f"'ktf32'; got {value!r}")
HEAD_DIMS = (64, 128, 256)
CODE_BITS = (2, 3, 4)


@attrs.frozen
class LowbitKernel(AttentionKernel):
    """Attend over channel-group keys (pre- or post-RoPE) and rotated-token values without reconstructing K/V."""

    head_sharding: ClassVar[str] = "head-local"
    reads_window_fill: ClassVar[bool] = True

    materializes: ClassVar[bool] = False
    pre_rope_keys: ClassVar[bool] = True
    coefficient_formats: ClassVar[tuple[str, ...]] = (CHANNEL_GROUP, CHANNEL_ALLOC, *VALUE_FORMATS)
    reads_residual_tiles: ClassVar[bool] = False  # restored tokens are found from the entries' lists, once

    backend: str = attrs.field(default="auto", validator=choice(BACKENDS), metadata={"doc": "'auto' (Triton on CUDA, the torch twin elsewhere), 'triton' or 'torch'"})
    tricks: str = attrs.field(default="", validator=_trick_names, metadata={
        "doc": "conversions the Triton kernel leaves out, '+'-separated of magic, vb16, ktf32, kfold ('magic+vb16': 8-10% "
               "faster on the H200, docs/kernels.md); '' none"})

    # ---------------------------------------------------------------------------------- checks
    def check_pipeline(self, pipeline: PipelineSlots, slot: str) -> None:
        where = f"pipeline '{pipeline.name}': slot '{slot}' ('{pipeline.use(slot)}')"
        if not pipeline.settings.compress:
            raise ComponentError(f"{where} reads packed storage, but the pipeline stores nothing packed (compress = false); use kernel 'reference'")
        if pipeline.use("basis") != "identity":
            raise ComponentError(f"{where} reads keys and values quantized as they are, but slot 'basis' is '{pipeline.use('basis')}'; use basis 'identity' or kernel 'reference'")
        if any(rank > 0 for rank in pipeline.component("router").levels()):
            formats = {pipeline.component_for("residual_quantizer", kind).packed_format for kind in ("keys", "values")}  # type: ignore[attr-defined]
            if formats != {"none.v1"} or pipeline.settings.residual_mode != "channels":
                raise ComponentError(
                    f"{where} reads residuals only as whole restored vectors (full-rank levels, residual_mode 'channels', "
                    f"residual_quantizer 'none'), but slot 'residual_quantizer' is '{pipeline.use('residual_quantizer')}' with "
                    f"residual_mode '{pipeline.settings.residual_mode}'; use kernel 'reference'")
        evictor = pipeline.component("evictor") if "evictor" in pipeline.slots else None
        if evictor is not None and evictor.evicts and (evictor.accumulates or evictor.reselects):
            raise ComponentError(f"{where} reads stored slots at their cache indices, but slot 'evictor' ('{pipeline.use('evictor')}') "
                                 "accumulates attention or re-selects stored tokens; use kernel 'reference'")
        keys = self._quantizer(pipeline, "keys", (CHANNEL_GROUP, CHANNEL_ALLOC), where)
        if keys.packed_format == CHANNEL_GROUP and (getattr(keys, "levels", "uniform") != "uniform" or keys.bits not in CODE_BITS):
            raise ComponentError(f"{where} reads keys as uniform {', '.join(map(str, CODE_BITS))}-bit codes, not {keys.bits}-bit {keys.levels}; use kernel 'reference'")
        values = self._quantizer(pipeline, "values", VALUE_FORMATS, where)
        if values.bits not in CODE_BITS or not values.symmetric:
            raise ComponentError(f"{where} reads values as symmetric {', '.join(map(str, CODE_BITS))}-bit codes, not {values.bits}-bit "
                                 f"{'symmetric' if values.symmetric else 'asymmetric'}; use kernel 'reference'")

    @staticmethod
    def _quantizer(pipeline: PipelineSlots, kind: str, packed: tuple[str, ...], where: str) -> Any:
        quantizer = pipeline.component_for("quantizer", kind).for_kind(kind)  # type: ignore[attr-defined]
        if quantizer.packed_format not in packed:
            slot = f"{kind}.quantizer" if f"{kind}.quantizer" in pipeline.slots else "quantizer"  # type: ignore[attr-defined]
            writers = "'channel-group' or 'channel-alloc'" if kind == "keys" else "'rotated-token'"
            raise ComponentError(f"{where} reads {kind} packed as {' or '.join(packed)}, but slot '{slot}' ('{pipeline.use(slot)}') packs "
                                 f"{quantizer.packed_format}; use {slot} {writers} or kernel 'reference'")
        return quantizer

    def check_engine(self, engine: Any) -> None:
        where = f"pipeline '{engine.pipeline.name}': slot 'kernel' ('{engine.pipeline.use('kernel')}')"
        if engine.shape.head_dim not in HEAD_DIMS:
            raise ModelError(f"{where} takes head_dim {HEAD_DIMS}; this model's head_dim {engine.shape.head_dim} is not one of them; use kernel 'reference'")
        if engine.accumulates or engine.reselects:
            raise ComponentError(f"{where}: the pipeline accumulates attention or re-selects stored tokens; use kernel 'reference'")
        values, keys = (engine.pipeline.component_for("quantizer", kind).for_kind(kind) for kind in ("values", "keys"))
        if getattr(values, "token_tiles", 0) and self.backend == "triton":  # "auto" on a GPU: refused at the launch
            if why := tiles_build_refusal(keys.packed_format, getattr(keys, "bits", 0), engine.shape.head_dim, values.group,
                                          getattr(keys, "group", 0)):
                raise ModelError(f"{where}: {why}; set the kernel's backend = 'torch' or drop token_tiles")
        partial = [rank for rank in engine.residual_levels if rank != engine.shape.head_dim]
        if partial:
            fix = "use kernel 'reference'"
            if engine.pipeline.use("router") == "sinks":
                fix = (f"set the router's rank = {engine.shape.head_dim} ([pipelines.{engine.pipeline.name}.router] in a registry "
                       "file extending this pipeline) or use kernel 'reference'")
            raise ModelError(f"{where} reads residuals only as whole restored vectors; residual ranks {partial} are below this "
                             f"model's head_dim {engine.shape.head_dim}; {fix}")

    # ---------------------------------------------------------------------------------- views
    def lowbit_view(self, view: LayerView, device: torch.device) -> LowbitView:
        """``view``'s packed storage as the kernel reads it (views of the stored tensors; the level table,
        rotation and rotary angles kept in ``view.scratch``). The views are made once per state of the packed
        storage (it changes only when a block is flushed: the group's ``flushes``, the token counts and the stored
        tensors themselves) and kept in ``view.scratch``; each call adds the exact window, which every step changes."""
        exact_k, exact_v = view.keys.exact, view.values.exact
        if exact_k is None or exact_v is None:
            raise CacheStateError(f"layer {view.layer}: the cache holds nothing for this layer yet")
        stamp = self._storage_stamp(view, exact_k)
        cached = view.scratch.get(("lowbit-view", view.layer, device))
        if cached is None or cached[0] != stamp:
            cached = (stamp, self._packed_view(view, device, exact_k, exact_v))
            self._check_tricks(view, cached[1], device)  # once per storage state, not per decode step
            view.scratch[("lowbit-view", view.layer, device)] = cached
        return attrs.evolve(cached[1], exact_k=exact_k, exact_v=exact_v, exact_fill=view.window_fill)

    def prepare(self, view: LayerView, device: torch.device) -> None:
        """The packed storage's views, made now (:meth:`lowbit_view`; they read the device once per storage state)."""
        self.lowbit_view(view, device)

    def storage_changed(self, scratch: dict, layers: tuple[int, ...]) -> None:
        """The packed views of ``layers`` are views of their previous storage: dropped (made anew at the next step)."""
        for key in [key for key in scratch if key[0] == "lowbit-view" and key[1] in layers]:
            del scratch[key]

    def _uses_triton(self, device: torch.device) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and device.type == "cuda")

    def _check_tricks(self, view: LayerView, packed: LowbitView, device: torch.device) -> None:
        """The launch's own check of ``tricks`` against this layer's storage, said for the layer before anything runs."""
        if not (self.tricks and packed.tokens and self._uses_triton(device)):
            return
        try:
            parse_tricks(self.tricks, resolve_variant(packed, "auto")[0], device.type == "cuda", packed)
        except ValueError as exc:
            raise ComponentError(f"layer {view.layer}: kernel 'lowbit' with tricks {self.tricks!r}: {exc}") from exc

    @staticmethod
    def _storage_stamp(view: LayerView, exact_k: torch.Tensor) -> tuple:
        """What identifies the packed storage's state: flushes, token counts, the residual entries, the batch shape
        and the stored tensors (a reordered or replaced tensor has another address)."""
        stored = [t.data_ptr() for kind_view in (view.keys, view.values) for t in kind_view.coefficients.values()
                  if isinstance(t, torch.Tensor)]
        entries = tuple(level.entries for kind_view in (view.keys, view.values) for level in kind_view.residuals)
        return (view.flushes, view.packed_tokens, view.passed_tokens, tuple(exact_k.shape[:2]), entries, tuple(stored),
                None if view.positions is None else view.positions.data_ptr())

    def _packed_view(self, view: LayerView, device: torch.device, exact_k: torch.Tensor, exact_v: torch.Tensor) -> LowbitView:
        """The packed storage's views (see :meth:`lowbit_view`), with this call's exact window."""
        for kind_view, packed in ((view.keys, (CHANNEL_GROUP, CHANNEL_ALLOC)), (view.values, VALUE_FORMATS)):
            if kind_view.coefficient_format not in packed:
                raise CacheStateError(f"layer {view.layer}: the {kind_view.kind} are packed as {kind_view.coefficient_format}; the lowbit kernel reads {' or '.join(packed)}")
        batch, heads, _, dim = exact_k.shape
        kq, vq = view.keys.quantizer, view.values.quantizer
        tables = view.scratch.get(("lowbit", view.layer, device))
        if tables is None:
            tables = self._tables(view, kq, vq, dim, device)
            view.scratch[("lowbit", view.layer, device)] = tables
        levels, rotation, inv_freq, rope_scale, kind = tables
        tokens = view.packed_tokens
        k, v = view.keys.coefficients, view.values.coefficients

        def rows(tensor: torch.Tensor, row: int) -> torch.Tensor:
            return tensor[row].reshape(batch * heads, *tensor.shape[-2:])

        alloc = view.keys.coefficient_format == CHANNEL_ALLOC
        key_bits = 0 if alloc else kq.bits  # channel-alloc: widths per channel and group, below
        if tokens == 0:
            blank = exact_k.new_zeros(batch * heads, 0, 1, dtype=torch.uint8)
            half = exact_k.new_zeros(batch * heads, 0, dim, dtype=torch.float16)
            return LowbitView(0, view.passed_tokens, blank, half, half, None, None, key_bits, kq.group, blank, half, vq.bits,
                              min(vq.group, dim), levels, rotation, inv_freq, rope_scale, exact_k, exact_v, kind)
        kr, vr = view.keys.coefficient_row, view.values.coefficient_row
        log8 = view.values.coefficient_format in LOG8_VALUE_FORMATS
        if log8 and tokens % vq.scale_tokens:
            raise CacheStateError(f"layer {view.layer}: {tokens} packed tokens are not whole spans of the values' {vq.scale_tokens}-token scale maxima")
        outliers = kq.outliers > 0
        # read as stored, no copy kept: channel-alloc widths (uint8, one per rotary pair where pairs share one; the
        # kernel sums each channel's offset), and the cache index of each slot of a cache that dropped tokens
        widths = rows(k["bits"], kr).contiguous() if alloc else None
        positions = None if view.positions is None else view.positions.reshape(batch * heads, tokens).contiguous()
        packed = LowbitView(
            tokens=tokens, first=view.passed_tokens - tokens, positions=positions,
            exact_first=view.passed_tokens if positions is not None else None,
            k_codes=rows(k["codes"], kr), k_zero=rows(k["zero"], kr), k_scale=rows(k["scale"], kr),
            k_out_index=rows(k["outlier_index"], kr) if outliers else None,
            k_out_value=rows(k["outlier_value"], kr) if outliers else None,
            k_bits=key_bits, k_group=kq.group, v_codes=rows(v["codes"], vr).reshape(batch * heads, tokens, -1),
            v_tiled=view.values.coefficient_format in TILED_VALUE_FORMATS, v_scale=rows(v["scale_log" if log8 else "scale"], vr),
            v_bits=vq.bits, v_group=min(vq.group, dim), v_levels=levels, rotation=rotation, inv_freq=inv_freq,
            rope_scale=rope_scale, exact_k=exact_k, exact_v=exact_v, level_kind=kind, k_widths=widths,
            v_scale_max=rows(v["scale_max"], vr) if log8 else None, v_scale_tokens=vq.scale_tokens if log8 else 1,
            v_levels16=levels.to(torch.bfloat16),  # the levels the dense kernel and vb16 read, once per storage state
            rotation_hadamard=vq.rotation == "hadamard",
        )
        if any(level.entries for kind_view in (view.keys, view.values) for level in kind_view.residuals):
            packed = self._restored(view, packed, device)
            packed = attrs.evolve(packed, hidden_below=hidden_prefix(packed, device))
        return packed

    @staticmethod
    def _restored(view: LayerView, packed: LowbitView, device: torch.device) -> LowbitView:
        """``packed`` with the tokens that full-rank residuals restore (e.g. the attention sinks) taken out of the
        packed pass and attended with the exact window at their exact vectors: dequantized codes plus residual
        (keys rotated at their position). Built once per set of residual entries (stored tokens never change)."""
        levels = [(kind_view, level) for kind_view in (view.keys, view.values) for level in kind_view.residuals if level.entries]
        batch, heads = packed.exact_k.shape[:2]
        tokens = packed.tokens
        key = ("lowbit-restored", view.layer, device, tuple(level.entries for _, level in levels))
        if key not in view.scratch:
            for old in [name for name in view.scratch if name[:3] == key[:3]]:
                del view.scratch[old]
            located = [tuple(t.long() for t in level.located()) for _, level in levels]  # (row, token) of each entry
            ids = torch.unique(torch.cat([row * tokens + token for row, token in located]))
            keys, values = _dequantized_at(packed, ids)
            positions = slot_positions(packed, device)
            positions = positions[ids % tokens] if positions.dim() == 1 else positions.reshape(-1)[ids]
            for (kind_view, level), (row, token) in zip(levels, located):
                at = torch.searchsorted(ids, row * tokens + token)
                delta = level.fields["q_values"].float().to(device)
                if kind_view.gates is not None:
                    delta = delta * kind_view.gates.float().to(device)[row % heads].unsqueeze(-1)
                if kind_view.kind == "keys":
                    keys = keys.index_add(0, at, rope_at(packed, delta, positions[at]) if packed.inv_freq is not None else delta)
                else:
                    values = values.index_add(0, at, delta)
            rows = ids // tokens
            counts = torch.bincount(rows, minlength=batch * heads)
            width = int(counts.max())
            slot = torch.arange(ids.numel(), device=device) - (counts.cumsum(0) - counts)[rows]
            dim = keys.shape[-1]
            out_k = torch.zeros(batch * heads, width, dim, device=device)
            out_v = torch.zeros_like(out_k)
            out_pos = torch.full((batch * heads, width), -1, dtype=torch.long, device=device)
            out_k[rows, slot], out_v[rows, slot], out_pos[rows, slot] = keys, values, positions
            hidden = torch.full((batch * heads, max(2, 1 << (width - 1).bit_length())), -1, dtype=torch.int32, device=device)
            hidden[rows, slot] = (ids % tokens).to(torch.int32)  # packed slots keep their index as later blocks are appended
            view.scratch[key] = (hidden, out_k.reshape(batch, heads, width, dim), out_v.reshape(batch, heads, width, dim),
                                 out_pos.reshape(batch, heads, width))
        hidden, out_k, out_v, out_pos = view.scratch[key]
        return attrs.evolve(packed, hidden_slots=hidden, restored_k=out_k, restored_v=out_v, restored_pos=out_pos)

    @staticmethod
    def _tables(view: LayerView, kq: Any, vq: Any, dim: int, device: torch.device) -> tuple:
        table = vq.level_table()
        levels = torch.tensor(table, dtype=torch.float32, device=device)
        rotation = vq.rotation_for(dim, device)
        if view.key_space != "pre-rope":
            return levels, rotation, None, 1.0, level_kind(table)
        if view.rotary is None:
            raise CacheStateError(f"layer {view.layer}: keys are stored before RoPE but the cache has no rotary module; build it with build_cache(pipeline, model)")
        inv_freq, scale = view.rotary.frequencies(view.layer)
        return levels, rotation, inv_freq.to(device).contiguous(), scale, level_kind(table)

    # ---------------------------------------------------------------------------------- attention
    def attend(self, view: LayerView, query: torch.Tensor, attention_mask: Any, scaling: float) -> torch.Tensor:
        """``query`` [B, Hq, 1, D] over ``view``'s packed tokens and exact window -> [B, 1, Hq, D]."""
        if query.shape[-2] != 1:
            raise CacheStateError(f"the lowbit kernel decodes one token per sequence; layer {view.layer} got {query.shape[-2]}")
        packed = self.lowbit_view(view, query.device)
        if view.positions is not None and attention_mask is not None:
            raise CacheStateError(f"layer {view.layer}: the lowbit kernel reads a cache that dropped tokens only when the query sees every "
                                  "held token (no padding); use kernel 'reference'")
        start = first_positions(view.scratch, attention_mask, query.device)
        q = query[:, :, 0, :]
        if self._uses_triton(query.device):
            rows, variant = q.shape[0] * packed.exact_k.shape[1], resolve_variant(packed, "auto")[0]
            out = lowbit_decode(packed, q, start, scaling, tricks=self.tricks, programs=None,  # the launch's splits
                                query_rows=None if variant == "dense" else _query_rows(view.scratch, rows, q, variant),
                                out_dtype=query.dtype)
        else:
            out = torch_lowbit_decode(packed, q, start, scaling)
        return out.to(query.dtype).unsqueeze(1)


def hidden_prefix(packed: LowbitView, device: torch.device) -> torch.Tensor | None:
    """int32 [B]: per batch row, the cache index below which ``packed``'s hidden slots are every packed slot (the same in
    each head), or None where they are not such a prefix (then the kernels check the list). Once per storage state: a
    pass over the slots' positions and one read to the host. The sinks router's restored tokens are the first
    positions: as a first visible position they cost the dense kernel nothing, as a list 11-19% (docs/kernels.md)."""
    batch, heads = packed.exact_k.shape[:2]
    held = packed.restored_pos.reshape(batch * heads, -1).to(device)
    below = held.max(-1).values.clamp(min=-1) + 1  # [BH]: one past the last hidden position (0: none)
    positions = slot_positions(packed, device)
    under = ((positions >= 0) & (positions < below[:, None])).sum(-1)  # slots below it, hidden or not
    rows = below.reshape(batch, heads)
    prefix = (under == (held >= 0).sum(-1)).all() & (rows == rows[:, :1]).all()
    return rows[:, 0].to(torch.int32).contiguous() if bool(prefix) else None


#: packed tokens dequantized at a time to find restored tokens' vectors (a bound on that temporary: B x H x this x D
#: float32 a few times over; the whole layer once made ~0.9 GB a 64K-token row on Llama-3-8B's shape)
RESTORE_SPAN = 1024


def _token_span(packed: LowbitView, lo: int, hi: int) -> LowbitView:
    """``packed``'s slots ``lo .. hi`` (whole key groups and value-scale spans) as a view of their own, without
    exact window, restored or hidden tokens."""
    kg, vs = packed.k_group, packed.v_scale_tokens
    by_group = lambda t: None if t is None else t[:, lo // kg : -(-hi // kg)]  # noqa: E731
    by_token = lambda t: None if t is None else t[:, lo:hi]  # noqa: E731
    return attrs.evolve(
        packed, tokens=hi - lo, first=packed.first + lo, k_codes=by_token(packed.k_codes), k_zero=by_group(packed.k_zero),
        k_scale=by_group(packed.k_scale), k_out_index=by_token(packed.k_out_index), k_out_value=by_token(packed.k_out_value),
        k_widths=by_group(packed.k_widths), v_codes=by_token(packed.v_codes), v_scale=by_token(packed.v_scale),
        v_scale_max=None if packed.v_scale_max is None else packed.v_scale_max[:, lo // vs : -(-hi // vs)],
        positions=by_token(packed.positions), restored_k=None, restored_v=None, restored_pos=None, hidden_slots=None,
        hidden_below=None,
    )


def _query_rows(scratch: dict, rows: int, q: torch.Tensor, variant: str) -> torch.Tensor:
    """The kernel's zero-padded float32 query rows [rows, 8 or 16 or more, D] (:func:`tile_rows` of ``variant``), kept
    in ``scratch`` for every layer (each call writes its query heads; the padding stays zero)."""
    shape = (rows, tile_rows(q.shape[1] * q.shape[0] // rows, variant), q.shape[-1])
    key = ("lowbit-query", shape, q.device)
    if key not in scratch:
        for old in [name for name in scratch if isinstance(name, tuple) and name[0] == "lowbit-query"]:
            del scratch[old]
        scratch[key] = torch.zeros(shape, dtype=torch.float32, device=q.device)
    return scratch[key]


def _dequantized_at(packed: LowbitView, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys (rotated at their positions) and values (rotated back) of the packed slots ``ids`` (flat indices
    ``row * tokens + slot``, sorted), float32 [N, D] each, dequantizing only spans of :data:`RESTORE_SPAN` slots
    that hold one of them, so the temporary does not grow with the context."""
    dim = packed.exact_k.shape[-1]
    span = math.lcm(packed.k_group, packed.v_scale_tokens, VALUE_TILE if packed.v_tiled else 1)
    span *= max(1, RESTORE_SPAN // span)
    rows, slots = ids // packed.tokens, ids % packed.tokens
    keys = torch.empty(ids.numel(), dim, device=ids.device)
    values = torch.empty_like(keys)
    for chunk in torch.unique(slots // span).tolist():
        lo = chunk * span
        part = _token_span(packed, lo, min(lo + span, packed.tokens))
        sel = (slots // span == chunk).nonzero().squeeze(-1)
        keys[sel] = torch_keys(part)[rows[sel], slots[sel] - lo]
        values[sel] = torch_values(part)[rows[sel], slots[sel] - lo] @ packed.rotation
    return keys, values


@hookimpl
def kvweave_register_kernels(registrar) -> None:
    registrar.add("lowbit", LowbitKernel)
