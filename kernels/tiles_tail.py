"""depthweave-kv's ``tiles`` pass with a shorter last wave (:func:`tail_segments`): its programs launched segment by
segment (grid (B x H, S): the last segments of every row are the last programs to start) and each row's last wave's
worth of segments shorter than the others, so that the pass drains for less time. Off by default: timed, it was slower
where it applies (:data:`TILES_TAIL`)."""

from __future__ import annotations

import bisect
import itertools

from kvweave.core.environment import env_setting
from kvweave.core.lazy import torch
from kvweave.kernels.decode_view import TILE, version_counts, version_segments
from kvweave.kernels.lowbit_dense import multiprocessors

#: where the tiles pass's programs are more than one wave, each row's last wave's worth of segments this share of the
#: others' length, in percent, and the programs launched segment-major (0: neither, the launch as timed; 100: segment-
#: major with every segment alike). At B = 32, 32K the pass drained for a quarter of its span (a 76.8 us tail of 300 on
#: an H200, docs/kernels.md "depthweave-kv's tiles pass and the one-row dense pass, SM by SM"); the dense kernel's
#: last wave at a third of its length took 1-8% off its calls ("The last wave of splits shorter, timed"). Timed for the
#: tiles pass (H100, Triton 3.6, graph time, docs/kernels.md "The tiles pass at 160 registers"): at B = 32, 64K (two
#: waves, the one cell timed where it applies) 4.57x SDPA off and at 100, 4.26x at 33, 4.32x at 25; the one-wave cells
#: (B = 8 at 32K and 64K, B = 32 at 32K; the same segments, launched segment-major) 1-4% faster, within the spread of
#: repeated runs (3.66-3.80x at B = 8, 32K). KVWEAVE_TILES_TAIL sets it
TILES_TAIL = env_setting("KVWEAVE_TILES_TAIL", 0, (0, 25, 33, 50, 100))
#: the tiles pass's programs an SM at once: one warp at 168 registers (Triton 3.6) or at 160 (Triton 3.9's build capped,
#: kvweave.kernels.depthweave_decode.tiles_register_cap), 12; 1,584 seen at once on 132 SMs
#: (H200, 2026-12-07, the section above)
TILES_PROGRAMS_PER_SM = 12


def seg_major() -> bool:
    """Whether the tiles pass is launched segment by segment (grid (B x H, S))."""
    return bool(TILES_TAIL)


def tail_segments(version_tokens: list[int], split: int, rows: int, slots: int | None, device,
                  percent: int | None = None) -> "torch.Tensor":
    """The segments [S, 3] (start, end, version) of ``version_tokens`` for ``rows`` rows (batch x KV heads) and
    ``slots`` programs at once (None: :data:`TILES_PROGRAMS_PER_SM` on each SM of ``device``): cut into ``split``
    tokens (:func:`~kvweave.kernels.decode_view.version_segments`), and where the programs are more than one wave with
    ``percent`` (None: :data:`TILES_TAIL`) below 100, the last ``slots / rows`` segments (a wave's worth, the last
    programs launched segment-major) that share of the others' length, the others longer to hold the rest. Every
    segment lies in one version and starts on a :data:`TILE`; together they hold each token once."""
    percent = TILES_TAIL if percent is None else percent
    uniform = version_segments(version_tokens, split, device)
    if not percent or percent >= 100:
        return uniform
    if slots is None:
        slots = TILES_PROGRAMS_PER_SM * multiprocessors(torch.device(device))
    count, total = uniform.shape[0], sum(version_tokens)
    if rows * count <= slots or count < 2:
        return uniform
    short = min(count - 1, -(-slots // max(1, rows)))
    brief = max(TILE, split * percent // 100 // TILE * TILE)
    tail = max(0, total - short * brief)  # the first token of the short segments (a multiple of TILE)
    length = -(-max(TILE, -(-tail // (count - short))) // TILE) * TILE
    starts = list(itertools.accumulate(version_tokens, initial=0))[:-1]  # no segment crosses a version's first token
    bounds = sorted(set(range(0, tail, length)) | set(range(tail, total, brief)) | {s for s in starts if s < total})
    bounds.append(total)
    return torch.tensor([(lo, hi, bisect.bisect_right(starts, lo) - 1) for lo, hi in zip(bounds, bounds[1:])],
                        dtype=torch.int32, device=device)


def resplit_rows(segments: "torch.Tensor", split: int, rows: int, slots: int | None = None,
                 percent: int | None = None) -> "torch.Tensor":
    """``segments`` [S, 3] cut again into ``split`` tokens, per version, with the shorter last wave of
    :func:`tail_segments` for ``rows`` rows (benchmarks: a view's own segments are cut when the cache is read)."""
    return tail_segments(version_counts(segments), split, rows, slots, segments.device, percent)
