"""Decode attention straight from DepthWeave-KV's packed storage: the Triton kernel's launchers.

One new query token per sequence attends over one layer's cache, which holds

- packed tokens ``0 .. T-1``: int8 coefficients ``c_t`` [r] with float16 scales per ``block`` channels,
  decoded by the basis version ``v(t)`` their block was encoded with: ``k_t = c_t P_v`` (``P_v`` [r, D] is
  this layer's column block of the window's token-factor basis);
- routed residuals: for some tokens, the first ``rho`` coordinates ``e_t`` (int4, one float16 scale per
  ``group``) on the layer's residual basis ``R`` [rho_max, D], weighted by the head's gate ``g``;
- the exact recent window (model dtype), at logical positions ``T .. T+W-1``.

So, with ``q`` pre-scaled, ``score_t = (q P_v^T) . c_t + g (q R^T)[:rho] . e_t`` and the output is
``sum_v (sum_{t in v} p_t c_t) P_v + (sum_t p_t g e_t) R + sum_w p_w v_w``: the kernel reads the int8
and int4 bytes, dequantizes them in registers and never writes a key or value vector to memory.

Work split (flash-decoding): the packed tokens are cut into segments that each lie inside one basis
version (``segments`` [S, 3] int32: start, end, version; starts multiples of ``TILE``), one program per
(segment, batch row x KV head) keeps an online softmax for the ``Hq / H`` query heads that share the KV
head (GQA) and writes a partial (max, sum, output); the exact window is one more partial; a combine pass
merges them. A token's residual entry is found through the list's tile index: per (row, 32-token tile)
the first entry and a bit mask of the tokens that have one, so the entry of token ``32 j + i`` is
``start + popcount(mask & (2^i - 1))``, read with no search and no scatter.

Rows of a batch may hold different numbers of real tokens (left padding): ``start`` [B] int32 is the
first logical position each row attends to.

Modules: :mod:`~kvweave.kernels.decode_view` (the :class:`DecodeView` of a layer, its segments),
:mod:`~kvweave.kernels.decode_triton` (the ``@triton.jit`` kernels), this one (:func:`fused_decode` and
:func:`fused_packed_logsumexp`, which check the view and launch them), :mod:`~kvweave.kernels.decode_torch`
(the torch twin) and :mod:`~kvweave.kernels.formats` (the packed formats, unpacked in torch).
"""

from __future__ import annotations

import functools
import os
from typing import TYPE_CHECKING, Any

from kvweave.core.environment import env_setting
from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.decode_view import MAX_LEVELS, TILE, DecodeView, ResidualLevel, check_view, placeholder, resplit
from kvweave.kernels import tiles_tail, timeline
from kvweave.kernels.launch import programmatic

if TYPE_CHECKING:
    from kvweave.kernels import decode_triton as jit
    from kvweave.kernels import depthweave_tiles_triton as tiles_jit
else:  # the @triton.jit kernels, imported (with triton) when a kernel is first launched
    jit = lazy_module("kvweave.kernels.decode_triton")
    tiles_jit = lazy_module("kvweave.kernels.depthweave_tiles_triton")

LOG2E = 1.4426950408889634

#: the batch rows x KV heads up to which the exact-window pass goes first with the tiles pass launched as its
#: programmatic dependent (:data:`kvweave.kernels.launch.PROGRAMMATIC_EXACT`): at B = 1 (8 rows) a call took 5-14% less
#: on an H100 in two runs, at B = 8 from 3% less to 8% more (docs/kernels.md "The combine launched before the packed
#: pass ends")
EARLY_EXACT_ROWS = 8

#: the combine pass :func:`fused_decode` launches by default: ``two-pass`` (a query head's slots read twice, 16 at a
#: time: their maxima, then their sums and outputs) or ``one-pass`` (:data:`COMBINE_SLICES` programs a query head, each
#: merging every slot for a slice of the columns in one step with a running maximum). One-pass took the combine from
#: 9.0 to 2.9 us at B = 1, 32K, and a call from 28.9 to 22.6 us replayed from a graph; at B = 8 it was no slower
#: (H100; docs/kernels.md "The probe's values measured from its keys' products, ...")
COMBINE = "one-pass"
COMBINES = ("two-pass", "one-pass")
#: the one-pass combine's programs a query head (each D / COMBINE_SLICES columns), and the slots times columns it
#: reads a step (more slots than that are merged in several steps)
COMBINE_SLICES = 4
COMBINE_ELEMENTS = 4096


def _pow2(n: int, least: int = 2) -> int:
    """The smallest power of two >= ``n``, at least ``least`` (Triton block sizes)."""
    return max(least, 1 << max(0, (int(n) - 1).bit_length()))


def _prepare(view: DecodeView, query: torch.Tensor, partials: int, outputs: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the inputs; the partial (max, sum, output) buffers of ``partials`` slots per query head (without
    ``outputs``, a one-element placeholder for the output: a pass that writes only the statistics)."""
    if jit.triton is None:
        raise RuntimeError("the fused DepthWeave-KV kernel needs triton (pip install triton)")
    check_view(view, query)
    batch, q_heads, dim = query.shape
    m = torch.empty(batch * q_heads * partials, dtype=torch.float32, device=query.device)
    if not outputs:
        return m, torch.empty_like(m), placeholder(query.device, torch.float32)
    return m, torch.empty_like(m), torch.empty(batch * q_heads * partials, dim, dtype=torch.float32, device=query.device)


def fused_decode(
    view: DecodeView, query: torch.Tensor, start: torch.Tensor | None, scale: float, split: int | None = None,
    block_tokens: int | None = None, num_warps: int | None = None, num_stages: int | None = 1, variant: str = "auto",
    combine: str | None = None,
) -> torch.Tensor:
    """The Triton kernel: ``query`` [B, Hq, D] -> [B, Hq, D] (query dtype). ``split``: tokens per segment
    (default: the view's segments); ``block_tokens``: tokens per loop iteration (a multiple of 32; default 64);
    ``num_warps``: warps a program (default 1, the fastest for both passes on the H200); ``num_stages``: Triton's
    software-pipelining depth for the packed-token loop (None: Triton's default, 3; 1, no pipelining, was 10 %
    faster for ``gather`` on the H200 at 128K tokens: ``benchmarks/kernel_tuning.py --stages``). ``variant``: the
    packed-token pass, ``tiles`` (:mod:`kvweave.kernels.depthweave_tiles_triton`: token-major, residual entries read
    as words), ``gather`` (one warp, residual coordinates gathered one by one) or ``auto`` (``tiles`` where the
    residual layout allows it, :func:`tiles_refusal`). On a GPU that allows it
    (:func:`kvweave.kernels.launch.programmatic`), up to :data:`EARLY_EXACT_ROWS` rows, the exact-window pass goes first
    and the tiles pass is launched as its programmatic dependent, so the two run at once. ``combine``: the combine pass,
    one of :data:`COMBINES` (None: :data:`COMBINE`)."""
    combine = COMBINE if combine is None else combine
    if combine not in COMBINES:
        raise ValueError(f"fused_decode: combine {combine!r} is not one of {', '.join(COMBINES)}")
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    device = query.device
    query = query.contiguous()
    if start is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
    start = start.to(device=device, dtype=torch.int32).contiguous()
    tokens = view.packed_tokens
    segments = view.segments
    if tokens and split is not None:
        segments = resplit(view.segments, split)
    n_seg = segments.shape[0] if tokens else 0
    partials = n_seg + 1
    m, l, acc = _prepare(view, query, partials)
    qk_scale = float(scale) * LOG2E
    tiles = pick_variant(view, variant) == "tiles"
    exact, fill = view.exact_k, view.exact_fill
    if exact.stride(-1) != 1 or exact.stride() != view.exact_v.stride():
        raise ValueError("the exact window's keys and values must share one layout, contiguous along head_dim")
    if fill is not None and (fill.dtype != torch.int32 or fill.numel() != 1 or fill.device != device):
        raise ValueError(f"the window's fill must be int32 [1] on {device}; got {fill.dtype} {tuple(fill.shape)} on {fill.device}")
    # the tiles pass launched as a programmatic dependent of the exact-window pass, which then goes first: both at once
    early = bool(n_seg) and tiles and batch * heads <= EARLY_EXACT_ROWS and programmatic(device, "exact")

    def exact_pass() -> None:
        jit._exact_split_kernel[(batch * heads,)](
            query, start, exact, view.exact_v, exact.stride(0), exact.stride(1), exact.stride(2), exact.shape[-2], tokens,
            m, l, acc, partials, n_seg, heads, qk_scale, placeholder(device) if fill is None else fill,
            GQ=gq, GQP=_pow2(gq, 16), D=dim, BLOCK=32, HAS_FILL=fill is not None, PDL=early,
        )

    if early:
        exact_pass()
    if n_seg:
        block = 64 if block_tokens is None else block_tokens
        warps = 1 if num_warps is None else num_warps
        if tiles:
            _launch_tiles(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block, warps,
                          num_stages, early=early)
        else:
            _launch_packed(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block, warps,
                           num_stages)
    if not early:
        exact_pass()
    out = torch.empty(batch, q_heads, dim, dtype=query.dtype, device=device)
    if combine == "one-pass":
        slices = min(COMBINE_SLICES, dim)
        chunk = min(_pow2(partials, 4), max(4, COMBINE_ELEMENTS * slices // dim))
        jit._combine_columns_kernel[(batch * q_heads, slices)](m, l, acc, out, partials, D=dim, DC=dim // slices, CHUNK=chunk)
    else:
        jit._combine_kernel[(batch * q_heads,)](m, l, acc, out, partials, D=dim, CHUNK=16)
    return out


def fused_packed_logsumexp(
    view: DecodeView, query: torch.Tensor, scale: float, block_tokens: int = 64, num_warps: int = 1, num_stages: int | None = 1,
    variant: str = "auto",
) -> torch.Tensor:
    """:func:`~kvweave.kernels.decode_torch.torch_packed_logsumexp` by the kernel's packed-token pass (its
    per-segment (max, sum) merged): ``query`` [B, Hq, D] -> float32 [B, Hq], -inf without packed tokens. ``variant``
    as :func:`fused_decode`'s (``auto``: ``tiles`` where it reads the layer). The ``tiles`` pass is launched without
    values (no value coefficient, residual or output read or written, and no output buffer made): 2.3-3.2x faster
    than ``gather`` over every observed query of each head on the H200 (eight a head: 32 columns a KV head)."""
    batch, q_heads, dim = query.shape
    n_seg = view.segments.shape[0] if view.packed_tokens else 0
    if not n_seg:
        return query.new_full((batch, q_heads), float("-inf"), dtype=torch.float32)
    tiles = pick_variant(view, variant) == "tiles"
    m, l, acc = _prepare(view, query, n_seg, outputs=not tiles)  # the tiles pass reads no value and writes no output
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    start = torch.zeros(batch, dtype=torch.int32, device=query.device)
    launch = functools.partial(_launch_tiles, values=False) if tiles else _launch_packed
    launch(view, query.contiguous(), view.segments, start, m, l, acc, n_seg, heads, gq, dim, float(scale) * LOG2E,
           block_tokens, num_warps, num_stages)
    m, l = m.view(batch, q_heads, n_seg), l.view(batch, q_heads, n_seg)
    top = m.amax(dim=-1, keepdim=True)
    total = (l * torch.exp2(m - top)).sum(dim=-1)
    return torch.where(total > 0, (top.squeeze(-1) + torch.log2(total)) / LOG2E, float("-inf"))


def _level_args(levels: tuple[ResidualLevel, ...], dummy: torch.Tensor) -> tuple[list[Any], list[int]]:
    """The kernel's four tensor arguments per residual level slot (``dummy`` for absent levels) and its
    (rank, group) constexprs ((0, 2) for absent levels)."""
    args: list[Any] = []
    meta: list[int] = []
    for i in range(MAX_LEVELS):
        if i < len(levels):
            lv = levels[i]
            args += [lv.packed, lv.scales, lv.tile_start, lv.tile_mask]
            meta += [lv.rank, lv.group]
        else:
            args += [dummy] * 4
            meta += [0, 2]
    return args, meta


def _packed_args(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale) -> tuple[tuple, list, dict, list, dict]:
    """The packed-token pass's grid, arguments (both variants take them in the same order), the constants they
    share, the levels' ranks and the ``gather`` pass's per-level groups, writing partial (max, sum, output) slots ``(row * gq + g) * partials + segment`` of ``m``, ``l``, ``acc``."""
    batch = query.shape[0]
    rank = view.k_codes.shape[-1]
    dummy = placeholder(query.device)
    k_args, k_meta = _level_args(view.k_levels, dummy)
    v_args, v_meta = _level_args(view.v_levels, dummy)
    for i, (a, b) in enumerate(zip(view.k_levels, view.v_levels)):
        if a.rank != b.rank or a.group != b.group:
            raise ValueError(f"residual level {i}: keys have rank {a.rank}/group {a.group}, values {b.rank}/{b.group}")
    levels = [rank_ for rank_ in k_meta[0::2] if rank_]
    if view.k_levels:
        rb = view.k_residual_basis
        if rb is None or view.v_residual_basis is None:
            raise ValueError("residual levels need the residual bases of keys and values")
        if rb.stride() != view.v_residual_basis.stride() or rb.stride(-1) != 1:
            raise ValueError("key and value residual bases must share one layout, contiguous along head_dim")
        rr = rb.shape[-2]
        if max(levels) > rr:
            raise ValueError(f"a residual level of rank {max(levels)} exceeds the residual basis rank {rr}")
        rb_strides = (rb.stride(0), rb.stride(1), rb.stride(2))
        krb, vrb = rb, view.v_residual_basis
    else:
        krb, vrb, rb_strides = dummy, dummy, (0, 0, 0)
    tiles = view.packed_tokens // TILE
    kg = view.k_gates if view.k_gates is not None else dummy
    vg = view.v_gates if view.v_gates is not None else dummy
    kc, ks = view.k_codes, view.k_scales
    kb = view.k_bases
    args = [
        query, segments, start,
        kc, ks, view.v_codes, view.v_scales, kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        kb, view.v_bases, kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3),
        krb, vrb, *rb_strides, kg, vg,
        *k_args, *v_args,
        m, l, acc, partials, heads, tiles, qk_scale,
    ]
    constants = dict(
        GQ=gq, D=dim, R=rank, RC=_pow2(rank, 16), RB=view.block,
        RANK0=k_meta[0], RANK1=k_meta[2], RANK2=k_meta[4],
        K_GATES=view.k_gates is not None, V_GATES=view.v_gates is not None,
    )
    return (segments.shape[0], batch * heads), args, constants, levels, dict(GROUP0=k_meta[1], GROUP1=k_meta[3], GROUP2=k_meta[5])


def _launch_packed(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block_tokens, num_warps, num_stages=None) -> None:
    """Launch the ``gather`` packed-token pass over ``segments`` (:func:`_packed_args`)."""
    grid, args, constants, levels, groups = _packed_args(view, query, segments, start, m, l, acc, partials, heads, gq,
                                                         dim, qk_scale)
    jit._packed_split_kernel[grid](
        *args, GQP=_pow2(gq, 16), RP=_pow2(max(levels, default=1), 16), **constants, **groups, BLOCK_T=block_tokens,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )


def tiles_refusal(view: DecodeView) -> str | None:
    """Why the ``tiles`` pass cannot read ``view``'s residual entries (None: it can). It reads an entry's codes and
    its scales as one word each: every level's rank a power of two from 2 to 16 and, where it holds entries, a multiple
    of one shared ``group`` (:func:`tiles_group`) with at most four scales an entry and its fields contiguous from an
    address their word width divides."""
    levels = view.k_levels + view.v_levels
    group = tiles_group(view)
    for level in levels:
        rank = level.rank
        if rank not in (2, 4, 8, 16):
            return f"residual rank {rank} is not 2, 4, 8 or 16"
        if not level.entries:  # nothing read: its group is a guess until it fills
            continue
        if level.group != group or rank % group:
            return f"residual rank {rank} takes {level.group} channels a scale where the others take {group}"
        if rank // group > 4:
            return f"residual rank {rank} has {rank // group} scales an entry (at most 4 are read as one word)"
        for name, field, width in (("codes", level.packed, rank // 2), ("scales", level.scales, 2 * (rank // group))):
            if field.numel() and (not field.is_contiguous() or field.data_ptr() % width):
                return f"residual rank {rank}: the {name} are not contiguous from a {width}-byte aligned address"
    return None


def tiles_group(view: DecodeView) -> int:
    """The int4 channels per scale the ``tiles`` pass reads every level's entries with: the largest among the levels
    that hold entries (2 where none does)."""
    return max((level.group for level in view.k_levels + view.v_levels if level.entries), default=2)


VARIANTS = ("auto", "tiles", "gather")

#: the ``tiles`` pass reads a step's residual words as a column [BLOCK, 1], in the layout its residual tile is made in
#: (:func:`kvweave.kernels.depthweave_tiles_triton._tiles_kernel`): 1,097 loop instructions at 102 registers against
#: 1,389 at 168 (Triton 3.6, sm_90). With :data:`TILES_AHEAD`, 1.15-1.49x faster on the H200 (docs/kernels.md, "The
#: tiles pass's switches timed, graphs for depthweave-kv, the flush's statistics without values"); off, the pass
#: before them
TILES_COLUMNS = True
#: the ``tiles`` pass loads each step's residual words during the step before (the same section)
TILES_AHEAD = True
#: on a GPU the ``tiles`` pass makes its int8 coefficients float16 four a register by byte permutes, no conversion
#: instruction a code, the same numbers (:func:`kvweave.kernels.depthweave_operands_triton._coefficients`)
TILES_BYTES = True
#: the ``tiles`` pass loads its value coefficients token-major, as the keys', and transposes them once float16
TILES_ROWS = True
#: the ``tiles`` pass loads its coefficient codes as 32-bit words, four codes a word: 0 no, 1 at the step's start, 2
#: during the step before (one scale a token, ``TILES_ROWS``, word-aligned codes only: :func:`word_codes`). With 2, a
#: call took 5-10% less at 32K, B = 8 and at 128K, B = 1 and 8, and 5% more at 32K, B = 1, with the same output bits
#: (H100, docs/kernels.md "The tiles pass's codes as words a step ahead"). Decode only: a flush's statistics pass
#: (:func:`fused_packed_logsumexp`, 32 query rows a KV head, no values) keeps the byte loads it was timed with
TILES_WORDS = 2
#: the registers a thread of the ``tiles`` pass may take on a GPU: unset (None), :func:`tiles_register_cap`'s rule; 0 the
#: compiler's choice; else that cap (KVWEAVE_TILES_REGISTERS). Triton 3.6 builds it in 168 with :data:`TILES_WORDS`,
#: Triton 3.9 in 179-185: 10-11 one-warp programs an SM, not the 12 :data:`kvweave.kernels.decode_view.WAVE_PROGRAMS`
#: counts on. At 160 both build it without a spill in 12. Timed (H100, 32K, graph time, docs/kernels.md "The tiles pass
#: at 160 registers"): Triton 3.9 at 160 against its own choice 3.08-3.10x -> 4.15-4.30x SDPA at B = 8, 3.79x ->
#: 5.12-5.17x at B = 32, the same at one row; Triton 3.6 3.71x -> 3.59x, 4.39x -> 4.35x, 2.35x -> 2.47x. At 144 or 128
#: (14 or 16 programs an SM) 3-36% slower everywhere with Triton 3.6 ("More programs an SM, shorter steps, the tile
#: index further ahead"). The same output bits at every cap. Decode only
TILES_REGISTERS: int | None = (env_setting("KVWEAVE_TILES_REGISTERS", 0, (0, 128, 144, 160, 168, 192, 255))
                               if "KVWEAVE_TILES_REGISTERS" in os.environ else None)
#: the cap :func:`tiles_register_cap` takes for a Triton after 3.6
TILES_LATER_TRITON_REGISTERS = 160
#: the ``tiles`` pass reads each step's tile index two steps ahead and the entries it points to one step ahead (with
#: :data:`TILES_AHEAD`), instead of both a step ahead. Off: built in 254 registers (Triton 3.6), 8 programs an SM, it
#: was 1-5% faster at one batch row and 3-23% slower at B = 8 and 32 (H100, docs/kernels.md "More programs an SM,
#: shorter steps, the tile index further ahead"). Decode only
TILES_INDEX = False
#: the ``tiles`` pass makes the query's products (by its basis rows and the residual basis's) after issuing the first
#: step's loads, so that those loads are in flight while the products wait for their operands: 1-4% off a call from
#: 32K, B = 8 to 128K, B = 32, the same at 32K, B = 1, the same output bits (the same section). Decode only
TILES_QUERY_LATE = True
#: the steps ahead whose coefficient codes and scales the ``tiles`` pass asks of the L2 cache on a GPU (0: none, the
#: default until timed; KVWEAVE_TILES_L2AHEAD). Decode only
TILES_L2AHEAD = env_setting("KVWEAVE_TILES_L2AHEAD", 0, (0, 2, 4, 8))


def word_codes(view: DecodeView, constants: dict) -> bool:
    """Whether the ``tiles`` pass can read ``view``'s coefficient codes as 32-bit words: one scale a token, a rank of
    whole words, both kinds' codes with the same word-aligned strides from word-aligned addresses."""
    if constants["RB"] < constants["R"] or constants["R"] % 4 or view.k_codes.stride() != view.v_codes.stride():
        return False
    return all(c.data_ptr() % 4 == 0 and c.stride(-1) == 1 and all(st % 4 == 0 for st in c.stride()[:-1])
               for c in (view.k_codes, view.v_codes))


def pick_variant(view: DecodeView, variant: str) -> str:
    """The packed-token pass ``variant`` names for ``view`` (``auto``: ``tiles`` unless :func:`tiles_refusal`)."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown fused kernel variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    refusal = tiles_refusal(view) if variant != "gather" else None
    if variant == "tiles" and refusal:
        raise ValueError(f"the tiles pass cannot read this layer: {refusal}")
    return "gather" if variant == "gather" or refusal else "tiles"


def tiles_register_cap() -> int | None:
    """The register cap the decode call's ``tiles`` pass is built with on a GPU (None: the compiler's choice):
    :data:`TILES_REGISTERS` where set (0: none); else :data:`TILES_LATER_TRITON_REGISTERS` for a Triton after 3.6
    and none for 3.6 and before (the builds and timings of :data:`TILES_REGISTERS`)."""
    if TILES_REGISTERS is not None:
        return TILES_REGISTERS or None
    import triton

    return TILES_LATER_TRITON_REGISTERS if _after_triton_3_6(triton.__version__) else None


@functools.lru_cache(maxsize=8)
def _after_triton_3_6(version: str) -> bool:
    return tuple(int(part) for part in version.split(".")[:2]) > (3, 6)


def _launch_tiles(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block_tokens, num_warps,
                  num_stages=None, values: bool = True, early: bool = False) -> None:
    """Launch the ``tiles`` packed-token pass over ``segments`` (:mod:`kvweave.kernels.depthweave_tiles_triton`);
    without ``values`` it writes only each slot's maximum and sum (``acc`` is not written); ``early``: as a
    programmatic dependent of the exact-window pass launched just before it (:data:`kvweave.kernels.launch.PROGRAMMATIC_EXACT`)."""
    if block_tokens not in (32, 64):
        raise ValueError(f"the tiles pass steps over 32 or 64 tokens (one or two tiles of the index), not {block_tokens}")
    grid, args, constants, levels, _ = _packed_args(view, query, segments, start, m, l, acc, partials, heads, gq, dim,
                                                    qk_scale)
    rmax = max(levels, default=0)
    group = tiles_group(view)
    seg_major = tiles_tail.seg_major()
    if seg_major:  # the last segments of every row the last programs (kvweave.kernels.tiles_tail)
        grid = (grid[1], grid[0])
    asm = query.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
    trace, traced = timeline.trace_for(tiles_jit._tiles_kernel, grid, m)  # kvweave.kernels.timeline: a placeholder
    tiles_jit._tiles_kernel[grid](
        *args, trace, TRACE=traced, G=_pow2(gq, 8), RP=_pow2(max(rmax, 1), 16), RMAX=rmax, GROUP=group, **constants, BLOCK=block_tokens,
        ASM=asm, COLUMNS=TILES_COLUMNS, AHEAD=TILES_AHEAD, VALUES=values, PDL=early, BYTES=asm and TILES_BYTES,
        ROWS=TILES_ROWS, INDEX=TILES_INDEX and values, QUERY_LATE=TILES_QUERY_LATE and values,
        L2AHEAD=TILES_L2AHEAD if values else 0, SEG_MAJOR=seg_major,
        WORDS=TILES_WORDS if values and TILES_WORDS and TILES_ROWS and word_codes(view, constants) else 0,
        num_warps=num_warps, **({"launch_pdl": True} if early else {}),
        **({} if num_stages is None else {"num_stages": num_stages}),
        **({"maxnreg": cap} if asm and values and (cap := tiles_register_cap()) else {}),
    )
