"""Bytes asked of the GPU's L2 cache before the loads that read them: ``prefetch.global.L2`` for each 128-byte line of
a contiguous range, one instruction a thread and line. A decode program whose steps each wait on DRAM in turn (a batch
of one row: a few steps a program, a few warps a scheduler) has its later steps' lines on their way while it computes
its first ones, and then waits on the L2's latency instead of DRAM's. Inline PTX: GPU builds only (the interpreter has
no inline assembly; a kernel calls these where its ``ASM`` says it is built for a GPU). Without triton the module
defines nothing (``triton`` is None)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

#: the L2 cache's line (bytes): one prefetch instruction each
LINE_BYTES = 128

if triton is not None:

    @triton.jit
    def _prefetch_lines(base, LINES: tl.constexpr):
        """Ask the L2 cache for the ``LINES`` 128-byte lines from ``base`` (a pointer into global memory, any element
        type, at the start of a line for whole lines). Nothing is returned and nothing read: the loads that follow
        find the lines in the L2 cache."""
        first = base.to(tl.pointer_type(tl.int8), bitcast=True)
        lines = (first + tl.arange(0, LINES) * 128).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                  is_pure=False, pack=1)

    @triton.jit
    def _prefetch_step(kc_ptr, vc_ptr, t0, KW: tl.constexpr, VW: tl.constexpr, BLOCK: tl.constexpr):
        """The lines of step ``t0``'s key words (``KW`` 32-bit words a token) and value words (``VW``; value tiles are
        the same bytes) of ``BLOCK`` tokens, from the row's first token's ``kc_ptr`` / ``vc_ptr``."""
        _prefetch_lines(kc_ptr + t0 * KW, BLOCK * KW * 4 // 128)
        _prefetch_lines(vc_ptr + t0 * VW, BLOCK * VW * 4 // 128)

    @triton.jit
    def _prefetch_bytes(base, nbytes, LINES: tl.constexpr):
        """Ask the L2 cache for the lines of ``nbytes`` bytes from ``base`` (a runtime count; ``LINES`` lines at most,
        the lines past the range asking again for its last one)."""
        first = base.to(tl.pointer_type(tl.int8), bitcast=True)
        lines = (first + tl.minimum(tl.arange(0, LINES) * 128, tl.maximum(nbytes - 1, 0))).to(tl.int64)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                  is_pure=False, pack=1)
