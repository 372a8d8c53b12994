"""Bytes asked of the GPU's L2 cache before the loads that read them, so that a decode program whose steps each wait
on DRAM in turn (a batch of one row: a few steps a program, a few warps a scheduler) has its later steps' bytes on
their way while it computes its first ones. Two ways (``BULK``): ``cp.async.bulk.prefetch.L2`` (Hopper), one
asynchronous request a contiguous range issued by the program's first thread; or ``prefetch.global.L2``, one
instruction a thread and 128-byte line, which on an H100 cost a warp about a DRAM round trip each (docs/kernels.md
"Codes asked of the L2 cache ahead"). Inline PTX: GPU builds only (the interpreter has no inline assembly; a kernel
calls these where its ``ASM`` says it is built for a GPU). Without triton the module defines nothing (``triton`` is
None)."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.core.environment import env_setting

    #: the kernels' prefetches as one bulk request a range (1, the default) or a line a thread (0):
    #: KVWEAVE_BULK_PREFETCH
    BULK_PREFETCH = tl.constexpr(bool(env_setting("KVWEAVE_BULK_PREFETCH", 1, (0, 1))))

    @triton.jit
    def _bulk_prefetch(base, nbytes, ALIGNED: tl.constexpr = False):
        """One request to the L2 cache for the ``nbytes`` bytes from ``base`` (a pointer into global memory; the range
        cut to whole 16-byte blocks, as the instruction takes them; ``ALIGNED``: the caller's range is whole blocks),
        issued by thread 0 of the program; nothing when the range holds no whole block. Asynchronous: no thread waits
        for it."""
        first = base.to(tl.pointer_type(tl.int8), bitcast=True).to(tl.int64)
        if ALIGNED:
            aligned, size = first, nbytes.to(tl.int32)
        else:
            aligned = first // 16 * 16  # the block the range begins in (an allocation begins on a block)
            size = ((first + nbytes) // 16 * 16 - aligned).to(tl.int32)
        tl.inline_asm_elementwise(
            "{\n\t.reg .pred p, q;\n\t.reg .b32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.ne.u32 q, $3, 0;\n\t"
            "setp.eq.and.u32 p, t, 0, q;\n\t"
            "@p cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
            "=r,l,r,r", [aligned, size, (size > 0).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _prefetch_bytes(base, nbytes, LINES: tl.constexpr, BULK: tl.constexpr, ALIGNED: tl.constexpr = False):
        """Ask the L2 cache for ``nbytes`` bytes from ``base`` (a runtime count, ``LINES`` 128-byte lines at most):
        with ``BULK`` one asynchronous request (:func:`_bulk_prefetch`), else one ``prefetch.global.L2`` a line, by the
        thread that holds it, the lines past the range asking again for its last one."""
        if BULK:
            _bulk_prefetch(base, nbytes, ALIGNED)
        else:
            first = base.to(tl.pointer_type(tl.int8), bitcast=True)
            lines = (first + tl.minimum(tl.arange(0, LINES) * 128, tl.maximum(nbytes - 1, 0))).to(tl.int64)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                                      is_pure=False, pack=1)

    @triton.jit
    def _prefetch_step(kc_ptr, vc_ptr, t0, t_hi, KW: tl.constexpr, VW: tl.constexpr, BLOCK: tl.constexpr,
                       STEPS: tl.constexpr, BULK: tl.constexpr):
        """The key words (``KW`` 32-bit words a token) and value words (``VW``; value tiles are the same bytes) of
        ``STEPS`` steps of ``BLOCK`` tokens from ``t0``, none past ``t_hi``, from the row's first token's ``kc_ptr`` /
        ``vc_ptr``: with ``BULK`` one request a stream (rows of whole 16-byte blocks from a step), else each step's
        whole lines (the steps past ``t_hi`` the last step's)."""
        if BULK:
            tokens = tl.maximum(tl.minimum(t_hi - t0, STEPS * BLOCK), 0)
            _bulk_prefetch(kc_ptr + t0 * KW, tokens * KW * 4, True)
            _bulk_prefetch(vc_ptr + t0 * VW, tokens * VW * 4, True)
        else:
            for j in tl.static_range(STEPS):
                t = tl.maximum(tl.minimum(t0 + j * BLOCK, t_hi - BLOCK), 0)
                _prefetch_bytes(kc_ptr + t * KW, BLOCK * KW * 4, BLOCK * KW * 4 // 128, False)
                _prefetch_bytes(vc_ptr + t * VW, BLOCK * VW * 4, BLOCK * VW * 4 // 128, False)
