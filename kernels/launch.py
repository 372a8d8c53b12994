"""One Triton kernel launch as data: what the lowbit decode kernels and the window kernels plan before they run; and how
many splits of each row's tokens a packed pass takes."""

from __future__ import annotations

import functools
from typing import Any

import attrs

from kvweave.core.environment import env_switch
from kvweave.core.lazy import torch
from kvweave.kernels import timeline


@attrs.frozen
class Launch:
    """One launch of a Triton kernel: ``kernel[grid](*args, **constants)`` fills ``outputs`` (the lowbit packed pass:
    ``m``, ``l`` [BH, splits, rows] and ``acc`` [BH, splits, rows, D], each split's running max, sum and output, rows =
    the KV head's query heads padded; the combine: the attention output [B, Hq, D]; the window kernels: the window)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constants: dict
    outputs: tuple
    #: the argument that takes a timeline's trace (a placeholder outside a recording: :mod:`kvweave.kernels.timeline`)
    trace_at: int | None = None

    def run(self) -> tuple:
        args, constants = self.args, self.constants
        if self.trace_at is not None and timeline.active():
            args, constants = timeline.traced(self.kernel, self.grid, args, constants, self.trace_at)
        self.kernel[self.grid](*args, **constants)
        return self.outputs


#: launch the lowbit combine as a programmatic dependent of the dense kernel's packed pass where the GPU and Triton can
#: (Hopper and later, Triton 3.4 and later) and that pass is one wave or has few rows
#: (kvweave.kernels.lowbit_dense.EARLY_COMBINE_WAVES, EARLY_COMBINE_ROWS):
#: its programs start while the packed pass's last ones run, attend the exact window and load the rotation, and wait for
#: the packed pass only before they read its splits (docs/kernels.md "The combine launched before the packed pass
#: ends"); the environment's KVWEAVE_PROGRAMMATIC_COMBINE=0 turns it off (to time both)
PROGRAMMATIC_COMBINE = env_switch("KVWEAVE_PROGRAMMATIC_COMBINE")

#: launch depthweave-kv's packed-token pass (``tiles``) as a programmatic dependent of its exact-window pass, which then
#: goes first, at few rows (kvweave.kernels.depthweave_decode.EARLY_EXACT_ROWS): the two run at once, the packed pass
#: waiting for the exact one only as it ends (the same section); KVWEAVE_PROGRAMMATIC_EXACT=0 turns it off
PROGRAMMATIC_EXACT = env_switch("KVWEAVE_PROGRAMMATIC_EXACT")


@functools.lru_cache(maxsize=None)
def _device_capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def capability(device: Any) -> tuple:
    """The compute capability of CUDA ``device`` (the current device where it names no index)."""
    return _device_capability(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _triton_has_gdc() -> bool:
    try:
        from kvweave.kernels import grid_dependency_triton
    except ImportError:  # no Triton at all
        return False
    return grid_dependency_triton.gdc_wait is not None


def programmatic(device: Any, use: str = "combine") -> bool:
    """Whether a kernel on ``device`` may be launched as a programmatic dependent of the kernel before it for ``use``
    ("combine": :data:`PROGRAMMATIC_COMBINE`, "exact": :data:`PROGRAMMATIC_EXACT`): a CUDA GPU of compute capability 9
    or more (NVIDIA's: a ROCm build reports its GPUs as "cuda" too) and a Triton with grid dependency control."""
    if not {"combine": PROGRAMMATIC_COMBINE, "exact": PROGRAMMATIC_EXACT}[use]:
        return False
    if device.type != "cuda" or torch.version.hip is not None or not _triton_has_gdc():
        return False
    return capability(device)[0] >= 9


def default_programs(rows: int) -> int:
    """Programs the packed pass of the kernels but "dense" aims for with ``rows`` (batch rows x KV heads) where the
    launch chooses: 528 (4 per SM of an H200), or at least 4 splits of each row's tokens where the rows alone fill more
    (the dense kernel at 64K, B = 64 / 128 on the H200: 1.34x -> 1.40x / 1.46x SDPA's speed, docs/kernels.md
    "model.generate with the dense kernel"; the dense kernel has its own since, :func:`kvweave.kernels.lowbit_dense.dense_splits`)."""
    return max(528, 4 * rows)


def choose_splits(tokens: int, programs: int, target: int = 528, least: int = 32) -> int:
    """Splits of the packed tokens per (row, head) so that about ``target`` programs run (``least`` tokens or more each)."""
    most = max(1, -(-tokens // least))
    return max(1, min(most, -(-target // max(1, programs))))


def query_tile(q: Any, query_rows: Any, heads: int, rows: int) -> Any:
    """The float32 [B x ``heads``, ``rows``, D] tile of the query heads ``q`` [B, Hq, D] that the packed passes but
    "dense" read, zero past each KV head's query heads: ``query_rows`` (a caller's, kept between calls) or a new one."""
    batch, q_heads, dim = q.shape
    tile = query_rows if query_rows is not None else q.new_zeros(batch * heads, rows, dim, dtype=torch.float32)
    if tile.shape != (batch * heads, rows, dim) or tile.dtype != torch.float32:
        raise ValueError(f"the lowbit kernel's query rows must be float32 {(batch * heads, rows, dim)}, got {tuple(tile.shape)}")
    tile[:, :q_heads // heads].copy_(q.reshape(batch * heads, q_heads // heads, dim))
    return tile
