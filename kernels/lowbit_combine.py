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
    from kvweave.kernels import lowbit_dense_triton as jit_dense
else:
    jit: Any = lazy_module("kvweave.kernels.lowbit_combine_triton")
    jit_dense: Any = lazy_module("kvweave.kernels.lowbit_dense_triton")

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
#: row read instead of all of it (64 KB a program at head_dim 128): 1 (the default) in the per-query-head combine where
#: it reads the splits in one tile and writes every channel (``WHOLE``, one slice) and in the combine by KV head up to
#: head_dim 128, both checked and timed on a GPU (H100, 2026-12-07: the combine at B = 32 24 -> 14 us, at B = 128
#: 59 -> 43 us; docs/kernels.md "The values' Hadamard rotation undone in the combine by a transform"); 2 also past one
#: tile of splits (head_dim 256, or more than 64 splits: every channel in one chunk of the splits' loop) and by KV head
#: at head_dim 256, checked under the interpreter and built for sm_90 but not yet run on a GPU; 0 reads the matrix
#: everywhere (KVWEAVE_COMBINE_HADAMARD)
COMBINE_HADAMARD = env_setting("KVWEAVE_COMBINE_HADAMARD", 1, (0, 1, 2))


def hadamard_stages(view: Any, dim: int, checked: bool) -> int:
    """The butterfly stages of the transform that undoes ``view``'s rotation in the combine (log2 ``dim``), or 0 where
    the combine reads the matrix: a Hadamard rotation of a power-of-two width, under :data:`COMBINE_HADAMARD` (1: only
    where the case is ``checked`` on a GPU; 2: everywhere)."""
    on = COMBINE_HADAMARD == 2 or COMBINE_HADAMARD == 1 and checked
    return dim.bit_length() - 1 if on and view.rotation_hadamard and dim & (dim - 1) == 0 else 0


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
    :data:`kvweave.kernels.lowbit_dense.EARLY_COMBINE_WAVES`)."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    m, l, acc = packed.outputs
    splits, slots = packed.grid[1], m.shape[1]  # the dense kernel's rows have a slot more (fused_combine's)
    out = torch.empty(batch, q_heads, dim, device=q.device, dtype=out_dtype or torch.float32)
    rest = view.restored_k is not None
    fill = view.exact_fill
    args = (
        m, l, acc, view.rotation, q.contiguous(), view.exact_k.contiguous(), view.exact_v.contiguous(),
        view.restored_k.contiguous() if rest else m, view.restored_v.contiguous() if rest else m,
        view.restored_pos.contiguous() if rest else m, start if start is not None else m, fill if fill is not None else m, out,
        splits, slots, view.exact_k.shape[-2], view.restored_k.shape[-2] if rest else 0, exact_start(view), float(scaling),
    )
    pdl = bool(packed.constants.get("PDL"))  # the packed pass lets it start early (the dense kernel, one wave)
    constants = dict(D=dim, G=m.shape[-1], HEADS=heads, GROUP=q_heads // heads, HAS_START=start is not None, HAS_REST=rest,
                     HAS_FILL=fill is not None, SB=32, CB=min(32, dim), EB=16, PDL=pdl)
    if pdl:  # started while the packed pass runs; its programs wait for it before they read the splits
        constants["launch_pdl"] = True
    if batch * heads <= COMBINE_GROUP_ROWS:  # few rows: the shorter chain of loads a program
        whole = splits <= COMBINE_WHOLE_SPLITS and dim <= COMBINE_WHOLE_DIM
        if whole:
            constants.update(SB=max(16, 1 << (splits - 1).bit_length()), CB=dim)
        slices = max(1, min(COMBINE_SLICES, dim // 16))
        stages = hadamard_stages(view, dim, whole) if slices == 1 else 0
        if stages and not whole:  # the splits in tiles of 32 x D, every channel in one chunk
            constants["CB"] = dim
        constants.update(WHOLE=whole, SLICES=slices, num_warps=COMBINE_WARPS, HAD=stages)
        return Launch(jit._lowbit_combine_kernel, (batch * q_heads * slices,), args, constants, (out,))
    rows = 1 << (q_heads // heads - 1).bit_length()  # tiles [rows, CB, D] and [EB, rows, D] of 32 x D each
    stages = hadamard_stages(view, dim, dim <= COMBINE_WHOLE_DIM)
    group = {"QR": rows, "CB": max(1, 32 // rows), "EB": max(1, 32 // rows), "HAD": stages}
    if stages:  # the splits' outputs whole: tiles [SB, rows, D] of 32 x D
        group["SB"] = max(1, 32 // rows)
    return Launch(jit._lowbit_combine_group_kernel, (batch * heads,), args, {**constants, **group}, (out,))


#: the combine done by the dense kernel's own programs instead of a second launch (:func:`fused_combine`): 1 (the
#: default) where the packed pass is more than one wave of programs (where it is one, the combine is launched early as a
#: programmatic dependent instead: :data:`kvweave.kernels.lowbit_dense.EARLY_COMBINE_WAVES`), 2 at every size, 0
#: never (KVWEAVE_FUSED_COMBINE)
FUSED_COMBINE = env_setting("KVWEAVE_FUSED_COMBINE", 1, (0, 1, 2))

#: each device's counters of the fused combine (int32, one a row of batch x KV heads, zero between launches: the last
#: program of a row sets its count back), and every buffer made before (a CUDA graph captured with one keeps using it)
_COUNTERS: dict[Any, list] = {}


def fused_counters(device: Any, rows: int) -> torch.Tensor | None:
    """``rows`` zero counters on ``device`` for :func:`fused_combine` (a device's buffer, grown where too short), or
    None while a CUDA graph is being captured and the buffer is too short (a new one cannot be zeroed outside the
    graph then: the combine is launched on its own). Launches that take them run one after another on a device's
    stream; two fused launches at once on two streams of a device would share the counts."""
    made = _COUNTERS.setdefault(str(device), [])
    if made and made[-1].numel() >= rows:
        return made[-1][:rows]
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    made.append(torch.zeros(max(rows, 2 * made[-1].numel() if made else 256), dtype=torch.int32, device=device))
    return made[-1][:rows]


def fused_refusal(view: Any, packed: Launch) -> str | None:
    """Why :func:`fused_combine` leaves the combine of ``packed`` (``view``'s packed pass) to its own launch, or None:
    :data:`FUSED_COMBINE`, a packed pass not the dense kernel's, one launched with the combine as its programmatic
    dependent (setting 1), a rotation not undone by a transform (:func:`hadamard_stages`; head_dim 256 with the setting
    at 2 only)."""
    dim = packed.constants.get("D", 0)
    if FUSED_COMBINE == 0:
        return "KVWEAVE_FUSED_COMBINE=0"
    if packed.kernel is not jit_dense._lowbit_dense_kernel:
        return "the packed pass is not the dense kernel's"
    if FUSED_COMBINE == 1 and packed.constants.get("PDL"):
        return "the packed pass is one wave, with the combine launched early beside it"
    if not hadamard_stages(view, dim, dim <= COMBINE_WHOLE_DIM):
        return "the values' rotation is not undone by a transform here (a Hadamard rotation, head_dim up to 128)"
    return None


def fused_combine(view: Any, packed: Launch, combine: Launch) -> Launch | None:
    """The dense kernel's packed pass ``packed`` with ``combine`` (:func:`plan_combine`'s launch for it) done by its own
    programs (``FUSE``): a row's split 0 attends the exact and restored tokens too, into the row's last slot, and the
    row's last program to end merges the splits into ``combine``'s output, so no second launch waits for the first's
    last wave. None where :func:`fused_refusal` says why not, or no counters can be had (:func:`fused_counters`)."""
    if fused_refusal(view, packed) is not None:
        return None
    m = packed.outputs[0]
    counts = fused_counters(m.device, m.shape[0])
    if counts is None:
        return None
    (_, _, _, rot, _, ek, ev, rk, rv, rpos, start, fill, out, _, _, exact, restored, exact_first, scaling) = combine.args
    dim, group = packed.constants["D"], packed.constants["QG"]
    rows = 1 << (group - 1).bit_length()
    args = packed.args[:-14] + (rot, ek, ev, rk, rv, rpos, start, fill, out, counts, exact, restored, exact_first,
                                scaling)
    tail = {name: combine.constants[name] for name in ("HAS_REST", "HAS_FILL")}
    constants = {**packed.constants, **tail, "FUSE": True, "PDL": False, "C_HAS_START": combine.constants["HAS_START"],
                 "QR": rows, "EB": max(1, 32 // rows), "SB": max(1, 32 // rows),
                 "HAD": hadamard_stages(view, dim, dim <= COMBINE_WHOLE_DIM)}
    return Launch(packed.kernel, packed.grid, args, constants, combine.outputs)
