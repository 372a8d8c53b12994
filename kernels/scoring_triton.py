"""The ``@triton.jit`` kernels of :func:`kvweave.kernels.scoring.repetition_key_max`: KVzip's scores of one repetition
chunk without its probabilities in memory. Without triton the module defines no kernel (``triton`` is None).

Layout: queries [BH, R, D] (R = query heads of a KV head x fed tokens, row ``r`` = head ``r // F``, fed token
``r % F``), keys [BH, L, D] (the context then the fed repetition from ``T``). The softmax a row takes runs over three
segments of keys: the first ``s0`` (sinks), the chunk's own context ``start .. start + n`` and the repetition
``T .. T + F`` up to the row's own token. Logits in the log2 domain (``scale2`` = scaling x log2 e).
"""

from __future__ import annotations

try:  # the kernels need triton; the torch path of kvweave.kernels.scoring does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _logits(q, keys, scale2, IEEE: tl.constexpr):
        """[BM, BN] float32 logits of rows ``q`` against ``keys`` (``IEEE``: float32 operands multiplied as float32, not
        TF32; half operands are exact either way)."""
        if IEEE:
            s = tl.dot(q, tl.trans(keys), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        return s * scale2

    @triton.jit
    def _segment_lse(q, k_ptr, k_row, first, count, rows_f, m, l, scale2, causal: tl.constexpr,
                     D: tl.constexpr, BD: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        """The running max ``m`` and sum ``l`` [BM] of rows ``q`` [BM, BD] taken over keys ``first .. first + count`` of
        ``k_row`` (``causal``: key ``j`` of the segment seen by rows whose fed token ``rows_f`` >= j)."""
        chan = tl.arange(0, BD)
        for j0 in range(0, count, BN):
            j = j0 + tl.arange(0, BN)
            keys = tl.load(k_ptr + k_row + (first + j).to(tl.int64)[:, None] * D + chan[None, :],
                           mask=(j[:, None] < count) & (chan[None, :] < D), other=0.0)
            s = _logits(q, keys, scale2, IEEE)
            seen = (j[None, :] < count)
            if causal:
                seen = seen & (j[None, :] <= rows_f[:, None])
            s = tl.where(seen, s, float("-inf"))
            top = tl.maximum(m, tl.max(s, axis=1))
            l = l * tl.exp2(m - top) + tl.sum(tl.exp2(s - top[:, None]), axis=1)
            m = top
        return m, l

    @triton.jit(do_not_specialize=["R", "F", "s0", "start", "n", "T", "L"])
    def _row_lse_kernel(q_ptr, k_ptr, lse_ptr, R, F, s0, start, n, T, L, scale2,
                        D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        """Each query row's log2-sum-exp2 over its three segments of keys into ``lse`` [BH, R] float32."""
        bh = tl.program_id(0).to(tl.int64)
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        chan = tl.arange(0, BD)
        q = tl.load(q_ptr + bh * R * D + rows.to(tl.int64)[:, None] * D + chan[None, :],
                    mask=(rows[:, None] < R) & (chan[None, :] < D), other=0.0)
        rows_f = rows % F
        k_row = bh * L * D
        m = tl.full([BM], float("-inf"), tl.float32)
        l = tl.zeros([BM], tl.float32)
        m, l = _segment_lse(q, k_ptr, k_row, 0, s0, rows_f, m, l, scale2, False, D, BD, BN, IEEE)
        m, l = _segment_lse(q, k_ptr, k_row, start, n, rows_f, m, l, scale2, False, D, BD, BN, IEEE)
        m, l = _segment_lse(q, k_ptr, k_row, T, F, rows_f, m, l, scale2, True, D, BD, BN, IEEE)
        tl.store(lse_ptr + bh * R + rows, m + tl.log2(l), mask=rows < R)

    @triton.jit(do_not_specialize=["R", "start", "n", "L"])
    def _key_max_kernel(q_ptr, k_ptr, lse_ptr, out_ptr, R, start, n, L, scale2,
                        D: tl.constexpr, BD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
        """Each key ``start + j`` (j < n) of the chunk's context: the largest probability any row gives it (every row sees
        the whole context: no mask) into ``out`` [BH, n] float32."""
        bh = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1) * BN + tl.arange(0, BN)
        chan = tl.arange(0, BD)
        keys = tl.load(k_ptr + bh * L * D + (start + j).to(tl.int64)[:, None] * D + chan[None, :],
                       mask=(j[:, None] < n) & (chan[None, :] < D), other=0.0)
        best = tl.zeros([BN], tl.float32)
        for r0 in range(0, R, BM):
            rows = r0 + tl.arange(0, BM)
            q = tl.load(q_ptr + bh * R * D + rows.to(tl.int64)[:, None] * D + chan[None, :],
                        mask=(rows[:, None] < R) & (chan[None, :] < D), other=0.0)
            lse = tl.load(lse_ptr + bh * R + rows, mask=rows < R, other=float("inf"))
            s = _logits(q, keys, scale2, IEEE)
            best = tl.maximum(best, tl.max(tl.exp2(s - lse[:, None]), axis=0))
        tl.store(out_ptr + bh * n + j, best, mask=j < n)
