"""Where a decode call's time goes among its programs: the kernels that take a trace (the lowbit dense packed pass and
combine, depthweave-kv's tiles pass) write, per program, when it started and ended on the GPU's global timer and its SM's cycle counter, which
SM ran it, and when a dependent launch's program was past its wait (:mod:`kvweave.kernels.timeline_triton`).

    with recording() as calls:       # every traced launch run inside is recorded
        lowbit_decode(...)
    pass_, combine = (programs(call.trace) for call in calls)
    print(summary(pass_, slots, combine))

A launch takes a trace where :class:`kvweave.kernels.launch.Launch` names the argument (``trace_at``) and its kernel
the ``TRACE`` constant (a launch made outside it asks :func:`trace_for`); outside a recording it passes a placeholder and ``TRACE`` = 0, so the production build reads no
timer. The timer stamps need a GPU build (inline PTX): under ``TRITON_INTERPRET=1`` a recording is refused."""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import attrs
import numpy as np

from kvweave.core.lazy import torch

#: the int64 fields of a program's row: start and end (global ns), start and end (SM cycles), SM, ready (SM cycles)
FIELDS = ("start_ns", "end_ns", "start_cycles", "end_cycles", "sm", "ready_cycles")

#: programs shorter than this on the global timer do not set the cycles' rate (the timer may step by a microsecond)
RATE_MIN_NS = 2000


@attrs.frozen
class Recorded:
    """One traced launch: its kernel's name, grid and trace [programs, 6] int64 (:data:`FIELDS`; on the launch's
    device until read)."""

    name: str
    grid: tuple
    trace: Any


_RECORDING: list[Recorded] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[Recorded]]:
    """Record every traced launch run inside (a list, filled as they run). Refused under the interpreter (the stamps
    are PTX) and when already recording."""
    global _RECORDING
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("a kernel timeline reads the GPU's timers by inline PTX, which the Triton interpreter "
                           "(TRITON_INTERPRET=1) does not run; record on a GPU")
    if _RECORDING is not None:
        raise RuntimeError("timeline recordings do not nest: one is already open")
    _RECORDING = []
    try:
        yield _RECORDING
    finally:
        _RECORDING = None


def active() -> bool:
    """Whether a recording is open."""
    return _RECORDING is not None


def _new_trace(kernel: Any, grid: tuple, device: Any) -> Any:
    """A zeroed [programs, 6] int64 trace for one launch of ``kernel`` over ``grid``, recorded in the open recording."""
    if _RECORDING is None:
        raise RuntimeError("no timeline recording is open")
    trace = torch.zeros(int(np.prod(grid)), len(FIELDS), dtype=torch.int64, device=device)
    _RECORDING.append(Recorded(getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)), tuple(grid), trace))
    return trace


def traced(kernel: Any, grid: tuple, args: tuple, constants: dict, trace_at: int) -> tuple[tuple, dict]:
    """The arguments and constants of a launch with its trace on: a zeroed [programs, 6] int64 buffer in place of
    argument ``trace_at`` (the placeholder), ``TRACE`` = 1; recorded in the open recording."""
    if "TRACE" not in constants:
        raise ValueError(f"kernel {getattr(kernel, '__name__', kernel)!r} takes no trace (no TRACE constant)")
    trace = _new_trace(kernel, grid, args[trace_at].device)
    return args[:trace_at] + (trace,) + args[trace_at + 1:], {**constants, "TRACE": 1}


def trace_for(kernel: Any, grid: tuple, placeholder: Any) -> tuple[Any, int]:
    """What a launch made outside :class:`kvweave.kernels.launch.Launch` passes for its trace argument and ``TRACE``:
    in an open recording a zeroed [programs, 6] int64 buffer on ``placeholder``'s device (recorded) and 1, else
    ``placeholder`` and 0."""
    if _RECORDING is None:
        return placeholder, 0
    return _new_trace(kernel, grid, placeholder.device), 1


@attrs.frozen
class Programs:
    """A launch's programs on one time axis (nanoseconds of the global timer): ``start``, ``end``, ``ready`` (past
    a dependent launch's wait; its start otherwise) and ``sm``, each [programs]; ``ns_per_cycle``: the SMs' clock."""

    start: np.ndarray
    end: np.ndarray
    ready: np.ndarray
    sm: np.ndarray
    ns_per_cycle: float


def programs(trace: Any, ns_per_cycle: float | None = None) -> Programs:
    """A trace [programs, 6] (:data:`FIELDS`) on one axis: each program's times from its SM's cycles, which are finer
    than the global timer, moved onto the global timer by the SM's offset (the median over its programs' starts and
    ends); the cycles' rate from the programs of at least :data:`RATE_MIN_NS` (``ns_per_cycle`` where given). A row of
    zeros (a program that did not write) is refused."""
    rows = np.asarray(trace.cpu() if hasattr(trace, "cpu") else trace, dtype=np.int64)
    if rows.ndim != 2 or rows.shape[1] != len(FIELDS):
        raise ValueError(f"a trace is [programs, {len(FIELDS)}] int64, got shape {rows.shape}")
    if not rows.shape[0] or (rows[:, 1] == 0).any():
        raise ValueError(f"{int((rows[:, 1] == 0).sum())} of {rows.shape[0]} programs wrote no stamp")
    t0, t1, c0, c1, sm, cr = (rows[:, i] for i in range(len(FIELDS)))
    if ns_per_cycle is None:
        long = (t1 - t0) >= RATE_MIN_NS
        if not long.any():
            long = np.ones_like(t0, dtype=bool)
        ns_per_cycle = float((t1 - t0)[long].sum()) / max(1.0, float((c1 - c0)[long].sum()))
    offsets = np.zeros(rows.shape[0])
    for unit in np.unique(sm):
        on = sm == unit
        pairs = np.concatenate([t0[on] - c0[on] * ns_per_cycle, t1[on] - c1[on] * ns_per_cycle])
        offsets[on] = np.median(pairs)
    return Programs(start=c0 * ns_per_cycle + offsets, end=c1 * ns_per_cycle + offsets, ready=cr * ns_per_cycle + offsets,
                    sm=sm, ns_per_cycle=ns_per_cycle)


def busy(progs: Programs, times: np.ndarray) -> np.ndarray:
    """How many of the programs run at each of ``times`` (start inclusive, end exclusive)."""
    starts, ends = np.sort(progs.start), np.sort(progs.end)
    return np.searchsorted(starts, times, side="right") - np.searchsorted(ends, times, side="right")


def summary(packed: Programs, slots: int, combine: Programs | None = None, full: float = 0.9) -> dict:
    """A packed pass's timeline against the ``slots`` programs its SMs hold at once, times in microseconds from its
    first program's start: ``span``; ``busy_share``, its programs' time over ``slots`` x ``span``; ``ramp``, until
    ``full`` of ``min(slots, programs)`` run; ``tail``, from the last moment so many ran to the end; program lengths
    (``median``, ``p10``, ``p90``, ``longest``) and each wave's median (``waves``: programs in order of start, ``slots``
    at a time); with ``combine`` (its launch's programs): its first start, first and last ready (past its wait), end,
    and ``after``, its end past the packed pass's."""
    origin = packed.start.min()
    length = (packed.end - packed.start) / 1e3
    span = (packed.end.max() - origin) / 1e3
    marks = np.concatenate([packed.start, packed.end])
    marks.sort()
    level = busy(packed, marks)
    target = full * min(slots, len(length))
    over = np.flatnonzero(level >= target)  # so many run from each such mark to the next
    ramp = (marks[over[0]] - origin) / 1e3 if len(over) else span
    tail = (packed.end.max() - marks[min(over[-1] + 1, len(marks) - 1)]) / 1e3 if len(over) else span
    order = np.argsort(packed.start)
    waves = [float(np.median(length[order[i:i + slots]])) for i in range(0, len(order), slots)]
    out = {"programs": int(len(length)), "slots": int(slots), "span": float(span),
           "busy_share": float(length.sum() / (slots * span)), "ramp": float(ramp), "tail": float(tail),
           "median": float(np.median(length)), "p10": float(np.percentile(length, 10)),
           "p90": float(np.percentile(length, 90)), "longest": float(length.max()), "waves": waves,
           "last_start": float((packed.start.max() - origin) / 1e3)}
    if combine is not None:
        out["combine"] = {"programs": int(len(combine.start)), "start": float((combine.start.min() - origin) / 1e3),
                          "ready_first": float((combine.ready.min() - origin) / 1e3),
                          "ready_last": float((combine.ready.max() - origin) / 1e3),
                          "end": float((combine.end.max() - origin) / 1e3),
                          "after": float((combine.end.max() - packed.end.max()) / 1e3)}
    return out


def sm_loads(start: np.ndarray, end: np.ndarray, sm: np.ndarray) -> list[dict]:
    """A pass's SMs grouped by how many of its programs each ran: per count, the SMs (``sms``), their programs' median
    and 90th-percentile length and the last end among them (``last_end``), in the unit of ``start`` and ``end``."""
    start, end, sm = (np.asarray(a) for a in (start, end, sm))
    held = np.bincount(sm)[sm]  # each program's SM's count
    out = []
    for count in np.unique(held):
        on = held == count
        length = end[on] - start[on]
        out.append({"programs": int(count), "sms": int(len(np.unique(sm[on]))), "median": float(np.median(length)),
                    "p90": float(np.percentile(length, 90)), "last_end": float(end[on].max())})
    return out

