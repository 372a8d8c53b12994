"""Decode attention over low-bit keys and values read in place: keys per channel over token groups
(``channel-group.v1``: uniform codes, a float16 minimum and scale per channel and group, exact outliers),
stored before the rotary embedding and rotated in registers at each token's position, and values per token
after a fixed orthogonal rotation (``rotated-token.v1``: codes on a table of levels, a float16 scale per
group of channels), accumulated in the rotated space and rotated back once per query.

:func:`lowbit_decode` runs a Triton kernel of :mod:`kvweave.kernels.lowbit_triton` (one program per batch row, KV head and split of the packed
tokens; each keeps a running max, sum and output, combined with the exact window by a second kernel), :func:`torch_lowbit_decode` is its
torch twin (the same arithmetic with whole tensors: the kernel's reference in the tests and the path on a
CPU). Both then merge the exact window (the recent tokens in the model's dtype) by their log-sum-exp.

Inputs (:class:`LowbitView`), ``BH`` = batch x KV heads, ``T`` packed tokens, ``D`` head dim:
``k_codes`` uint8 [BH, T, D * kbits / 8] (``channel-alloc.v1``: [BH, T, mean bits * D / 8] with ``k_widths``
uint8 [BH, T / kgroup, W] as stored, channel ``c`` of a token group ``k_widths[..., c % W]`` bits wide, at the
offset the widths of the channels before it sum to; W = D / 2 where rotary pairs share a width),
``k_zero``/``k_scale`` float16 [BH, T / kgroup, D],
``k_out_index`` uint8 / ``k_out_value`` float16 [BH, T, KO]; ``v_codes`` uint8 [BH, T, D * vbits / 8],
``v_scale`` float16 [BH, T, D / vgroup] (``rotated-token-log8.v1``: uint8 ``k`` for ``v_scale_max * 2**(-k / 16)``,
with ``v_scale_max`` float16 [BH, T / v_scale_tokens, D / vgroup]); ``v_levels`` float32 [2 ** vbits] (the value of each code before
the scale), ``rotation`` float32 [D, D] (a stored value vector is ``y @ rotation``); ``inv_freq`` float32
[D / 2] and ``rope_scale`` (the rotary embedding's angles ``position * inv_freq``, cos and sin times
``rope_scale``; None: keys stored after it); ``first`` the logical position of packed token 0.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import attrs

from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.formats import VALUE_TILE, unpack_codes, unpack_varwidth, untile_codes
from kvweave.kernels.launch import Launch, choose_splits, default_programs, query_tile
from kvweave.kernels.lowbit_combine import exact_start, plan_combine  # noqa: F401 - plan_combine re-exported
from kvweave.kernels.lowbit_dense import (auto_dense, dense_block, dense_launch, dense_refusal, dense_slots, dense_splits,
                                          multiprocessors, rope_registers, tiles_refusal)
from kvweave.kernels import lowbit_tail
from kvweave.kernels.lowbit_tricks import (  # noqa: F401 - TRICKS: the names lowbit_decode takes; the others read here
    TRICKS, fast_path, parse_tricks, whole_byte_codes, whole_byte_keys, wide_groups)

if TYPE_CHECKING:
    from kvweave.kernels import lowbit_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.lowbit_triton")

#: packed tokens per loop step of a program
BLOCK_T = 32

@attrs.frozen
class LowbitView:
    """One layer's packed low-bit storage as the kernel reads it (see the module docstring)."""

    tokens: int
    first: int
    k_codes: torch.Tensor
    k_zero: torch.Tensor
    k_scale: torch.Tensor
    k_out_index: torch.Tensor | None
    k_out_value: torch.Tensor | None
    k_bits: int
    k_group: int
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_bits: int
    v_group: int
    v_levels: torch.Tensor
    rotation: torch.Tensor
    inv_freq: torch.Tensor | None
    rope_scale: float
    exact_k: torch.Tensor
    exact_v: torch.Tensor
    #: how the wide kernel makes value levels (:func:`level_kind`); None: read from ``v_levels`` per call
    level_kind: tuple[int, float, float] | None = None
    #: ``channel-alloc.v1`` keys: the widths as stored, uint8 [BH, T / k_group, W] (channel ``c`` takes ``c % W``;
    #: None: ``channel-group.v1``, every channel ``k_bits`` wide)
    k_widths: torch.Tensor | None = None
    #: ``rotated-token-log8.v1`` values: the float16 maximum of each ``v_scale_tokens`` tokens' scales, [BH, T /
    #: v_scale_tokens, D / v_group] (``v_scale`` then holds the one-byte steps below it); None: float16 scales
    v_scale_max: torch.Tensor | None = None
    v_scale_tokens: int = 1
    #: a cache that dropped tokens: each packed slot's cache index, int32 [BH, T] (-1: a filler slot, never
    #: attended), and the cache index of the exact window's first token (None: slots ``first ..`` in order)
    positions: torch.Tensor | None = None
    exact_first: int | None = None
    #: tokens restored to their exact vectors by full-rank residuals (e.g. the attention sinks): attended with the
    #: exact window, ``restored_k``/``restored_v`` [B, H, r, D] float32 (keys rotated at their position),
    #: ``restored_pos`` int64 [B, H, r] their cache indices (-1: padding); their packed slots are hidden
    #: (``hidden_slots``)
    restored_k: torch.Tensor | None = None
    restored_v: torch.Tensor | None = None
    restored_pos: torch.Tensor | None = None
    #: packed slots the packed pass does not attend (their tokens are attended exactly, above): int32 [BH, R], R a
    #: power of two, -1 for none
    hidden_slots: torch.Tensor | None = None
    #: int32 [B]: per batch row, the cache index below which every packed slot is hidden and no other is (the sinks:
    #: the packed pass then starts at it, a first visible position, instead of checking the list); None: the list
    hidden_below: torch.Tensor | None = None
    #: ``v_levels`` as bfloat16, made once with the view (the ``dense`` kernel's and the ``vb16`` trick's; None: per call)
    v_levels16: torch.Tensor | None = None
    #: a window kept for a CUDA graph: int32 [1], the tokens it held before this step (``exact_k`` / ``exact_v`` are then
    #: buffers of its capacity, their first ``exact_fill + 1`` rows attended); None: every row of ``exact_k``
    exact_fill: torch.Tensor | None = None
    #: ``v_codes`` hold 2/4-bit codes in tiles of 64 tokens (``rotated-token-tiled.v1``; read by the dense kernel, twin)
    v_tiled: bool = False
    #: ``rotation`` is a Sylvester Hadamard matrix with a scale a column (``rotated-token``'s ``"hadamard"``: H diag(s) /
    #: sqrt(D)): the combine rotates the output back by a fast Walsh-Hadamard transform and the matrix's first row
    #: (the scales), not by reading the matrix
    rotation_hadamard: bool = False


def slot_positions(view: LowbitView, device: torch.device) -> torch.Tensor:
    """Each packed slot's cache index: [BH, T] (``positions``) or [T] (``first ..`` in order)."""
    if view.positions is not None:
        return view.positions.to(device).long()
    return view.first + torch.arange(view.tokens, device=device)


def value_scales(view: LowbitView) -> torch.Tensor:
    """Each packed token's value scales as stored, float32 [BH, T, D / v_group]."""
    if view.v_scale_max is None:
        return view.v_scale.float()
    return view.v_scale_max.float().repeat_interleave(view.v_scale_tokens, dim=-2) * torch.exp2(-view.v_scale.float() / 16)


def torch_keys(view: LowbitView) -> torch.Tensor:
    """The packed keys as attention reads them (rotated at their positions): float32 [BH, T, D]."""
    if view.k_widths is not None:
        widths = view.k_widths.long()
        widths = widths.repeat(1, 1, view.exact_k.shape[-1] // widths.shape[-1])  # channel c takes width c % W
        codes = unpack_varwidth(view.k_codes, widths).float()  # a row of widths for every k_group tokens
    else:
        codes = unpack_codes(view.k_codes, view.k_bits).float()
    bh, tokens, dim = codes.shape
    rows = torch.arange(tokens, device=codes.device) // view.k_group
    keys = view.k_zero.float()[:, rows] + codes * view.k_scale.float()[:, rows]
    if view.k_out_index is not None:
        keys = keys.scatter(-1, view.k_out_index.long(), view.k_out_value.float())
    if view.inv_freq is None:
        return keys
    return rope_at(view, keys, slot_positions(view, codes.device))


def rope_at(view: LowbitView, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``keys`` [..., D] rotated at cache indices ``positions`` [...] (or broadcast to them) as the kernel does."""
    angles = positions.float()[..., None] * view.inv_freq.float()  # [..., D / 2]
    cos = torch.cat((angles.cos(), angles.cos()), -1) * view.rope_scale
    sin = torch.cat((angles.sin(), angles.sin()), -1) * view.rope_scale
    half = keys.shape[-1] // 2
    partner = torch.cat((-keys[..., half:], keys[..., :half]), -1)
    return keys * cos + partner * sin


def torch_values(view: LowbitView) -> torch.Tensor:
    """The packed values in the rotated space (before ``rotation``): float32 [BH, T, D]."""
    codes = unpack_codes(view.v_codes, view.v_bits)
    if view.v_tiled:  # each 64 rows of bytes are a tile's
        codes = untile_codes(codes.reshape(codes.shape[0], -1, VALUE_TILE * codes.shape[-1]), view.v_bits)
    bh, tokens, dim = codes.shape
    levels = view.v_levels.float()[codes]
    scale = value_scales(view).repeat_interleave(view.v_group, dim=-1)
    return levels * scale


def _merge_exact(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float,
                 m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge the packed part (running max ``m``, sum ``l``, un-normalised output ``acc`` in the original
    space, [B, Hq] / [B, Hq, D]) with attention over the exact window: [B, Hq, D] float32."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    group = q_heads // heads
    keys = view.exact_k.float().repeat_interleave(group, dim=1)  # [B, Hq, n, D]
    values = view.exact_v.float().repeat_interleave(group, dim=1)
    positions = (exact_start(view) + torch.arange(keys.shape[-2], device=q.device)).expand(batch, q_heads, -1)
    if view.exact_fill is not None:  # rows past this step's token are not the window's
        positions = positions.masked_fill(torch.arange(keys.shape[-2], device=q.device) > view.exact_fill.to(q.device), -1)
    if view.restored_k is not None:  # tokens restored by full-rank residuals, attended as exact ones
        keys = torch.cat((view.restored_k.to(q.device).repeat_interleave(group, dim=1), keys), dim=-2)
        values = torch.cat((view.restored_v.to(q.device).repeat_interleave(group, dim=1), values), dim=-2)
        positions = torch.cat((view.restored_pos.to(q.device).repeat_interleave(group, dim=1), positions), dim=-1)
    logits = torch.einsum("bhd,bhnd->bhn", q.float(), keys) * scaling
    hidden = positions < 0
    if start is not None:
        hidden = hidden | (positions < start[:, None, None])
    logits = logits.masked_fill(hidden, -math.inf)
    m_e = logits.amax(-1) if logits.shape[-1] else torch.full_like(m, -math.inf)
    top = torch.maximum(m, m_e)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_p = torch.exp(m - top)
    p_e = torch.exp(logits - top[..., None])
    total = w_p * l + p_e.sum(-1)
    out = w_p[..., None] * acc + torch.einsum("bhn,bhnd->bhd", p_e, values)
    return out / total[..., None]


def torch_lowbit_decode(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Decode attention of ``q`` [B, Hq, D] over the packed tokens and the exact window: [B, Hq, D] float32
    (the kernel's torch twin)."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    group = q_heads // heads
    if view.tokens == 0:
        empty_m = torch.full((batch, q_heads), -math.inf, device=q.device)
        return _merge_exact(view, q, start, scaling, empty_m, torch.zeros_like(empty_m), q.new_zeros(batch, q_heads, dim).float())
    keys = torch_keys(view).reshape(batch, heads, view.tokens, dim).repeat_interleave(group, dim=1)
    values = torch_values(view).reshape(batch, heads, view.tokens, dim).repeat_interleave(group, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q.float(), keys) * scaling
    positions = slot_positions(view, q.device)
    positions = positions.reshape(batch, heads, view.tokens).repeat_interleave(group, dim=1) if positions.dim() > 1 else positions[None, None, :]
    hidden = positions < 0  # filler slots
    if start is not None:
        hidden = hidden | (positions < start[:, None, None])
    if view.hidden_slots is not None:
        slots = torch.arange(view.tokens, device=q.device)
        listed = (slots[None, :, None] == view.hidden_slots.to(q.device).long()[:, None, :]).any(-1)  # [BH, T]
        hidden = hidden | listed.reshape(batch, heads, view.tokens).repeat_interleave(group, dim=1)
    logits = logits.masked_fill(hidden, -math.inf)
    m = logits.amax(-1)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - safe[..., None])
    acc = torch.einsum("bht,bhtd->bhd", p, values) @ view.rotation
    return _merge_exact(view, q, start, scaling, safe.masked_fill(torch.isinf(m), -math.inf), p.sum(-1), acc)


def level_kind(levels: list[float] | tuple[float, ...]) -> tuple[int, float, float]:
    """How the wide kernel makes value ``levels`` (one per code): (1, 0, 0) the mid-rise levels ``code -
    (count - 1) / 2``, (2, l0, l1) four symmetric levels -l1, -l0, l0, l1, else (0, 0, 0): a table load."""
    count = len(levels)
    uniform = [code - (count - 1) / 2 for code in range(count)]
    if all(abs(a - b) < 1e-7 for a, b in zip(levels, uniform)):
        return 1, 0.0, 0.0
    if count == 4 and abs(levels[0] + levels[3]) < 1e-7 and abs(levels[1] + levels[2]) < 1e-7:
        return 2, float(levels[2]), float(levels[3])
    return 0, 0.0, 0.0


#: the Triton kernels :func:`lowbit_decode` can run: "wide" (at most 4 value groups: whole half-head key tiles, codes of
#: whole bytes unpacked in registers, value scales on the probabilities; steps of at least :data:`WIDE_MIN_BLOCK`),
#: "general" (one pass per channel, gathered bytes, any storage), "dense" (keys in 2- or 4-bit channel-group codes, before
#: RoPE rotated in registers, 2- or 4-bit values, whole steps, codes as 32-bit words: :mod:`kvweave.kernels.lowbit_dense_triton`); "auto":
#: "dense" where it reads the storage at the GPU-checked head_dims, else "wide" where it does, else "general" (each
#: measured faster than the next on the H200; a "subtile" kernel was removed after 3230605; docs/kernels.md)
VARIANTS = ("auto", "wide", "general", "dense")

#: the "wide" kernel's smallest step: its sm_90 build of 16-token steps was off the twin by ~1.5 (H200, docs/kernels.md)
WIDE_MIN_BLOCK = 32


def resolve_variant(view: LowbitView, variant: str, block: int | None = None) -> tuple[str, int]:
    """The kernel ``variant`` (:data:`VARIANTS`) and tokens a step (``block``; None: the variant's own) for ``view``:
    "auto" resolved ("dense" where it reads the storage and no step is asked for, else "wide" where its value groups fit,
    key groups are whole steps and the steps asked for allow it, else "general"); a variant that cannot read ``view``
    with those steps refused."""
    if variant not in VARIANTS:
        raise ValueError(f"lowbit kernel variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if variant == "wide" and not wide_groups(view):
        raise ValueError(f"the lowbit 'wide' kernel takes values in at most 4 channel groups of at least 16 (got groups of "
                         f"{view.v_group} channels at head_dim {view.exact_k.shape[-1]}); use variant 'general'")
    if variant == "dense":
        why = dense_refusal(view, block)
        if why is not None:
            raise ValueError(f"the lowbit 'dense' kernel cannot read this storage: {why}; use variant 'wide' or 'general'")
        return variant, dense_block(view) if block is None else block
    if variant == "auto" and block is None and auto_dense(view):
        return "dense", dense_block(view)  # measured faster than "wide" there
    if view.v_tiled:
        raise ValueError(tiles_refusal(view, variant, block))
    if variant == "auto":
        wide = wide_groups(view) and view.k_group % WIDE_MIN_BLOCK == 0
        variant = "wide" if wide and (block is None or block >= WIDE_MIN_BLOCK) else "general"
    if block is None:
        block = WIDE_MIN_BLOCK if variant == "wide" else 16
    if variant == "wide" and block < WIDE_MIN_BLOCK:
        raise ValueError(f"the lowbit 'wide' kernel takes steps of at least {WIDE_MIN_BLOCK} tokens, got block={block}")
    return variant, block


#: the fewest rows a KV head's query heads take in the packed pass: 8 for the "dense" kernel, whose products take them
#: as 8 columns at least (910 -> 696 loop instructions from 16 rows, ``benchmarks/kernel_sass.py``), else 16
MIN_TILE_ROWS = {"dense": 8}


def tile_rows(group: int, variant: str = "wide") -> int:
    """The rows a KV head's ``group`` query heads take in ``variant``'s packed pass (zero beyond them)."""
    return max(MIN_TILE_ROWS.get(variant, 16), 1 << (group - 1).bit_length())


def plan_launch(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float, block: int | None = None,
                num_warps: int = 4, variant: str = "auto", programs: int | None = 528, lowp: bool | None = None,
                tricks: str = "", query_rows: torch.Tensor | None = None) -> Launch:
    """The launch :func:`lowbit_decode` makes for ``view`` (``view.tokens`` > 0); ``lowp``: bfloat16 tile operands
    (None: where ``q`` is on a GPU); ``tricks``: conversions left out (:data:`TRICKS`); ``programs``: the programs aimed
    for (None: the launch's, ``dense_splits`` or ``default_programs``); ``query_rows``: the float32 [B x
    KV heads, rows, D] query heads padded to the tile's rows, zero beyond them, that a caller keeps (None: made here;
    the "dense" kernel reads ``q`` where it is and takes none)."""
    variant, block = resolve_variant(view, variant, block)
    lowp = q.is_cuda if lowp is None else lowp
    trick = parse_tricks(tricks, variant, lowp, view)
    (batch, q_heads, dim), heads = q.shape, view.exact_k.shape[1]
    group, rows = q_heads // heads, tile_rows(q_heads // heads, variant)
    # the dense kernel reads the query heads where they are: no padded copy, no kernel before its own
    padded = q.contiguous() if variant == "dense" else query_tile(q, query_rows, heads, rows)
    hidden = view.hidden_slots
    if view.hidden_below is not None:  # the hidden slots as the first visible position of the packed pass
        start, hidden = (view.hidden_below if start is None else torch.maximum(start, view.hidden_below)), None
    if view.k_group % block:
        raise ValueError(f"the lowbit kernel's tile of {block} tokens must divide the keys' token group {view.k_group}")
    if programs is None:  # the launch's choice
        splits = (dense_splits(batch * heads, view.tokens // block, multiprocessors(q.device), dim, hidden is not None,
                               num_warps, rope_registers(view))
                  if variant == "dense" else choose_splits(view.tokens, batch * heads, default_programs(batch * heads), BLOCK_T))
    else:
        splits = choose_splits(view.tokens, batch * heads, programs, BLOCK_T)
    tail = None
    if variant == "dense" and programs is None and lowbit_tail.DENSE_TAIL:  # the launch's, the last wave shorter
        groups = -(-view.tokens // view.k_group)
        slots = dense_slots(multiprocessors(q.device), dim, hidden is not None, num_warps, rope_registers(view))
        splits, long_len, long_splits, short_len = lowbit_tail.dense_tail(batch * heads, groups, splits, slots)
        split_len = long_len * view.k_group
        if long_splits < splits:
            tail = (long_splits, short_len * view.k_group)
    else:
        split_len = -(-view.tokens // splits)
        split_len = -(-split_len // view.k_group) * view.k_group  # splits start on a token group
        splits = -(-view.tokens // split_len)
    m = torch.empty(batch * heads, splits, rows, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch * heads, splits, rows, dim, device=q.device)
    ko = 0 if view.k_out_index is None else view.k_out_index.shape[-1]
    dummy = view.k_zero
    varw = view.k_widths is not None
    args = (
        padded, view.k_codes, view.k_zero, view.k_scale,
        view.k_out_index if ko else dummy, view.k_out_value if ko else dummy,
        view.k_widths if varw else dummy,
        view.v_codes, view.v_scale, view.v_scale_max if view.v_scale_max is not None else view.v_scale, view.v_levels,
        view.inv_freq if view.inv_freq is not None else view.v_levels,
        start if start is not None else m, view.positions if view.positions is not None else m,
        hidden if hidden is not None else m, m, l, acc,
        view.tokens, heads, splits, split_len, view.first, float(view.rope_scale), float(scaling),
    )
    constants = dict(
        D=dim, G=rows, KBITS=view.k_bits, KGROUP=view.k_group, KO=ko, VBITS=view.v_bits, VGROUP=view.v_group,
        ROPE=view.inv_freq is not None, HAS_START=start is not None, BLOCK=block, LOWP=lowp,
        num_warps=num_warps, KWIDTH=view.k_codes.shape[-1], VARW=varw, VLOG=view.v_scale_max is not None,
        VST=view.v_scale_tokens, HAS_POS=view.positions is not None, KWW=view.k_widths.shape[-1] if varw else 1,
        HID=0 if hidden is None else hidden.shape[-1],
        APPROX=lowp and os.environ.get("TRITON_INTERPRET") != "1",  # the interpreter has no hardware cos/sin
    )
    if variant == "general":
        return Launch(jit._lowbit_kernel, (batch * heads, splits), args, {**constants, "MAGIC": trick["MAGIC"]}, (m, l, acc))
    kind, l0, l1 = view.level_kind or level_kind(view.v_levels.tolist())
    if variant == "dense":
        kernel, grid, dense_args, dense_constants = dense_launch(view, args, constants, kind, l0, l1, group, trick, tail)
        return Launch(kernel, grid, dense_args, dense_constants, (m, l, acc), trace_at=len(dense_args) - 1)
    fast_k, fast_v = whole_byte_codes(view)
    conversions = {name: trick[name] for name in ("MAGIC", "VB16", "KTF32", "KFOLD")}
    constants = {**constants, "FASTK": fast_k, "FASTV": fast_v, "LEVELS": kind, **conversions}
    table16 = view.v_levels
    if trick["VB16"] and kind == 0:
        table16 = view.v_levels16 if view.v_levels16 is not None else view.v_levels.to(torch.bfloat16)
    return Launch(jit._lowbit_wide_kernel, (batch * heads, splits), (*args, l0, l1, table16), constants, (m, l, acc))


def lowbit_decode(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float,
                  block: int | None = None, num_warps: int = 4, variant: str = "auto", programs: int | None = 528,
                  tricks: str = "", lowp: bool | None = None, query_rows: torch.Tensor | None = None, out_dtype: Any = None) -> torch.Tensor:
    """The Triton path of :func:`torch_lowbit_decode`: [B, Hq, D] float32 (or ``out_dtype``, rounded by the kernel). On
    a GPU the two products of each tile take bfloat16 operands (float32 sums), as sdpa over the reference path's
    bfloat16 keys does; under ``TRITON_INTERPRET=1`` they stay float32, so the tests compare it with the twin closely.
    ``variant``: which kernel (:data:`VARIANTS`); ``tricks``: conversions left out (:data:`TRICKS`); ``lowp``: bfloat16
    tile operands (None: on a GPU); ``query_rows``: see :func:`plan_launch`."""
    if jit.triton is None:
        raise RuntimeError("the lowbit kernel needs Triton; use backend 'torch'")
    if variant not in VARIANTS:  # refused even where no kernel runs (plan_launch resolves it against the storage)
        raise ValueError(f"lowbit kernel variant {variant!r}: expected one of {', '.join(VARIANTS)}")
    if view.tokens == 0:
        return torch_lowbit_decode(view, q, start, scaling)
    packed = plan_launch(view, q, start, scaling, block, num_warps, variant, programs, lowp, tricks, query_rows)
    packed.run()
    return plan_combine(view, q, start, scaling, packed, out_dtype).run()[0]
