"""How the ``lowbit`` decode attention's combine is launched (:func:`plan_combine`; the kernels are in
:mod:`kvweave.kernels.lowbit_combine_triton`): the splits of the packed pass merged, their output rotated back, the
exact window and the restored tokens attended."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvweave.core.environment import env_setting
from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.launch import Launch

if TYPE_CHECKING:
    from kvweave.kernels import lowbit_combine_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.lowbit_combine_triton")

#: rows (batch x KV heads) past which the combine takes a KV head's query heads in one program (H200, docs/kernels.md)
COMBINE_GROUP_ROWS = 256

#: the most splits a row the per-query-head combine reads in one tile, its rotation in one: no loop between
#: its loads (H200, docs/kernels.md "The query heads where the model left them, the combine without loops")
COMBINE_WHOLE_SPLITS = 64

#: the largest head_dim whose rotation the combine reads in one tile (D x D float32: 128 registers a thread at 128)
COMBINE_WHOLE_DIM = 128


#: the programs a query head the per-query-head combine runs in, each writing a slice of the output's channels (the
#: splits' and exact tokens' weights computed in each, only the slice's values, outputs and rotation columns read):
#: more, shorter programs where the rows are few; KVWEAVE_COMBINE_SLICES sets it (1, 2, 4 or 8; at most one slice a 16
#: channels)
COMBINE_SLICES = env_setting("KVWEAVE_COMBINE_SLICES", 1, (1, 2, 4, 8))

#: warps a program of the per-query-head combine; KVWEAVE_COMBINE_WARPS sets it (2, 4, 8 or 16)
COMBINE_WARPS = env_setting("KVWEAVE_COMBINE_WARPS", 4, (2, 4, 8, 16))

#: a Hadamard rotation (the view's ``rotation_hadamard``) undone by a fast Walsh-Hadamard transform, the matrix's first
#: row read instead of all of it (64 KB a program at head_dim 128): 1 (the default) in every combine, 0 reads the matrix
#: (KVWEAVE_COMBINE_HADAMARD). Checked and timed on an H100 (2026-12-07): the per-query-head combine reading the splits
#: in one tile at B = 32 24 -> 14 us, the combine by KV head at B = 128 59 -> 43 us; at head_dim 256, where the splits
#: are merged in tiles, every channel in one chunk of the splits' loop, 16.5 -> 7.9 us at B = 8 and 39 -> 11 us at
#: B = 32 (docs/kernels.md "The values' Hadamard rotation undone in the combine by a transform")
COMBINE_HADAMARD = env_setting("KVWEAVE_COMBINE_HADAMARD", 1, (0, 1))


def hadamard_stages(view: Any, dim: int) -> int:
    """The butterfly stages of the transform that undoes ``view``'s rotation in the combine (log2 ``dim``), or 0 where
    the combine reads the matrix: a Hadamard rotation of a power-of-two width, :data:`COMBINE_HADAMARD` on."""
    on = COMBINE_HADAMARD == 1 and view.rotation_hadamard
    return dim.bit_length() - 1 if on and dim & (dim - 1) == 0 else 0


def exact_start(view: Any) -> int:
    """The cache index of the exact window's first token."""
    return view.first + view.tokens if view.exact_first is None else view.exact_first


def plan_combine(view: Any, q: torch.Tensor, start: torch.Tensor | None, scaling: float, packed: Launch,
                 out_dtype: Any = None) -> Launch:
    """The launch that combines the splits of ``packed`` (a :class:`kvweave.kernels.lowbit_decode.LowbitView`'s packed
    pass), rotates their output back and merges the exact window and restored tokens (``_merge_exact``'s arithmetic),
    :data:`COMBINE_SLICES` programs a query head (one per KV head past :data:`COMBINE_GROUP_ROWS` rows): [B, Hq, D]
    float32, or rounded to nearest even in ``out_dtype`` (the model's, saving a conversion). Launched as a programmatic
    dependent of the packed pass where that pass asks for it (its ``PDL``:
    :data:`kvweave.kernels.lowbit_dense.EARLY_COMBINE_WAVES`, :data:`~kvweave.kernels.lowbit_dense.EARLY_COMBINE_ROWS`)."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    m, l, acc = packed.outputs
    splits = m.shape[1]
    out = torch.empty(batch, q_heads, dim, device=q.device, dtype=out_dtype or torch.float32)
    rest = view.restored_k is not None
    fill = view.exact_fill
    args = (
        m, l, acc, view.rotation, q.contiguous(), view.exact_k.contiguous(), view.exact_v.contiguous(),
        view.restored_k.contiguous() if rest else m, view.restored_v.contiguous() if rest else m,
        view.restored_pos.contiguous() if rest else m, start if start is not None else m, fill if fill is not None else m, out,
        splits, view.exact_k.shape[-2], view.restored_k.shape[-2] if rest else 0, exact_start(view), float(scaling),
        m,  # the trace's placeholder (kvweave.kernels.timeline: the last argument)
    )
    pdl = bool(packed.constants.get("PDL"))  # the packed pass lets it start early (the dense kernel, one wave)
    constants = dict(D=dim, G=m.shape[-1], HEADS=heads, GROUP=q_heads // heads, HAS_START=start is not None, HAS_REST=rest,
                     HAS_FILL=fill is not None, SB=32, CB=min(32, dim), EB=16, PDL=pdl, TRACE=0)
    if pdl:  # started while the packed pass runs; its programs wait for it before they read the splits
        constants["launch_pdl"] = True
    if batch * heads <= COMBINE_GROUP_ROWS:  # few rows: the shorter chain of loads a program
        whole = splits <= COMBINE_WHOLE_SPLITS and dim <= COMBINE_WHOLE_DIM
        if whole:
            constants.update(SB=max(16, 1 << (splits - 1).bit_length()), CB=dim)
        slices = max(1, min(COMBINE_SLICES, dim // 16))
        stages = hadamard_stages(view, dim) if slices == 1 else 0
        if stages and not whole:  # the splits in tiles of 32 x D, every channel in one chunk
            constants["CB"] = dim
        constants.update(WHOLE=whole, SLICES=slices, num_warps=COMBINE_WARPS, HAD=stages)
        return Launch(jit._lowbit_combine_kernel, (batch * q_heads * slices,), args, constants, (out,),
                      trace_at=len(args) - 1)
    rows = 1 << (q_heads // heads - 1).bit_length()  # tiles [rows, CB, D] and [EB, rows, D] of 32 x D each
    stages = hadamard_stages(view, dim)
    group = {"QR": rows, "CB": max(1, 32 // rows), "EB": max(1, 32 // rows), "HAD": stages}
    if stages:  # the splits' outputs whole: tiles [SB, rows, D] of 32 x D
        group["SB"] = max(1, 32 // rows)
    return Launch(jit._lowbit_combine_group_kernel, (batch * heads,), args, {**constants, **group}, (out,),
                  trace_at=len(args) - 1)
