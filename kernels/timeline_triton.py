"""What a traced kernel writes about each of its programs (:mod:`kvweave.kernels.timeline`): the GPU's global timer
(nanoseconds, shared by the SMs), the SM's cycle counter and the SM's number, read by inline PTX, so a GPU build only
(the interpreter runs no PTX: :func:`kvweave.kernels.timeline.traced` refuses it there). Without triton the module
defines no function (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _global_ns():
        """The global timer, nanoseconds (the same clock on every SM)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _cycles():
        """This SM's cycle counter (finer than the global timer, not aligned across SMs)."""
        return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)

    @triton.jit
    def _sm_id():
        """The number of the SM this program runs on."""
        return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _begin_stamp():
        """A program's start: (global ns, cycles)."""
        return _global_ns(), _cycles()

    @triton.jit
    def _end_stamp(trace_ptr, program, begin_ns, begin_cycles, ready_cycles):
        """Program ``program``'s row of the trace [programs, 6] int64: start and end in global ns, start and end in
        cycles, the SM, and the cycle it was ready (a dependent launch: past its wait; else its start)."""
        end_ns, end_cycles = _global_ns(), _cycles()
        field = tl.arange(0, 8)
        row = tl.where(field == 0, begin_ns, tl.where(field == 1, end_ns, tl.where(field == 2, begin_cycles, tl.where(
            field == 3, end_cycles, tl.where(field == 4, _sm_id().to(tl.int64), ready_cycles)))))
        tl.store(trace_ptr + program.to(tl.int64) * 6 + field, row, mask=field < 6)
