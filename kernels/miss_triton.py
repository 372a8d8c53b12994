"""The ``@triton.jit`` kernel of :func:`kvweave.kernels.miss.block_miss`: a block's difference from its reconstruction
and each token's relative miss, in one pass. Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernel needs triton; the encoder's torch path does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _block_miss_kernel(
        source_ptr, approx_ptr, difference_ptr, miss_ptr,
        tokens, source_outer, source_token, approx_outer, approx_token,
        D: tl.constexpr, BD: tl.constexpr, TB: tl.constexpr,
    ):
        """``TB`` tokens of one leading row ``o``: ``source`` [O, n, D] (any float dtype) minus ``approx`` [O, n, D]
        (float32), each read at its strides (``*_outer``, ``*_token``; channels side by side), written to
        ``difference`` float32 [O, n, D] (contiguous); ``miss`` float32 [O, n] = |difference| / max(|source|, 1e-9),
        both norms summed in float32 (NaN carried through)."""
        row = tl.program_id(0).to(tl.int64)
        tok = tl.program_id(1) * TB + tl.arange(0, TB)
        live = tok < tokens
        chan = tl.arange(0, BD)
        both = live[:, None] & (chan < D)[None, :]
        tok64 = tok.to(tl.int64)[:, None]
        x = tl.load(source_ptr + row * source_outer + tok64 * source_token + chan[None, :], mask=both, other=0.0).to(tl.float32)
        a = tl.load(approx_ptr + row * approx_outer + tok64 * approx_token + chan[None, :], mask=both, other=0.0)
        d = x - a
        tl.store(difference_ptr + (row * tokens + tok64) * D + chan[None, :], d, mask=both)
        missed = tl.sqrt(tl.sum(d * d, 1))
        size = tl.maximum(tl.sqrt(tl.sum(x * x, 1)), 1e-9, propagate_nan=tl.PropagateNan.ALL)
        tl.store(miss_ptr + row * tokens + tok, missed / size, mask=live)
