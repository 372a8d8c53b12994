"""``@triton.jit`` helpers of the ``lowbit`` kernels that turn packed codes into tile operands: unpacking whole-byte
codes, integers made float by their bits, bfloat16 value operands without a conversion, and the logits of keys stored
after RoPE with their scales folded into the query (the ``TRICKS`` of :mod:`kvweave.kernels.lowbit_decode`).
Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _as_float(code, MAGIC: tl.constexpr):
        """int32 codes (0 .. 2**23) as float32: a conversion instruction, or (``MAGIC``) the code's bits put into the
        mantissa of 2**23 and 2**23 subtracted (exact: an integer op and an add instead of a conversion, which CUDA's
        throughput table gives at an eighth of an add's rate; whether Hopper's ``I2FP`` is that slow is for a GPU
        timing to say)."""
        if MAGIC:
            return (code | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        return code.to(tl.float32)

    @triton.jit
    def _plus128(code):
        """Codes 0 .. 127 as the bfloat16 numbers ``128 + code``, made from their bits (``0x4300 | code``: the code in
        the mantissa of 128) instead of converted."""
        return (code | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)

    @triton.jit
    def _level16(code, vlev16_ptr, LEVELS: tl.constexpr, l0, l1, n0, n1):
        """bfloat16 value operands made without a float conversion (``VB16``): the uniform levels as ``128 + code``
        (the code's bits in the mantissa of 128; the caller takes 128 + the offset times the probabilities' sum
        off the product), the four normal levels chosen among the bfloat16 scalars ``l0, l1`` and their negations
        ``n0, n1``, other levels from the table's bfloat16 copy."""
        if LEVELS == 1:
            return _plus128(code)
        elif LEVELS == 2:
            positive = tl.where((code == 0) | (code == 3), l1, l0)
            negative = tl.where((code == 0) | (code == 3), n1, n0)
            return tl.where(code >= 2, positive, negative)
        else:
            return tl.load(vlev16_ptr + code)

    @triton.jit
    def _unpack(byte, BITS: tl.constexpr):
        """[N, W] packed bytes -> [N, W * 8 // BITS] int32 codes in stream order (code ``c`` at bits ``(c % per) *
        BITS`` of byte ``c // per``), interleaved in registers."""
        b = byte.to(tl.int32)
        if BITS == 4:
            return tl.interleave(b & 15, (b >> 4) & 15)
        else:  # 2 bits: codes 4j, 4j + 1, 4j + 2, 4j + 3 at shifts 0, 2, 4, 6
            return tl.interleave(tl.interleave(b & 3, (b >> 4) & 3), tl.interleave((b >> 2) & 3, (b >> 6) & 3))

    @triton.jit
    def _folded_logits(q_lo, q_hi, kb_lo, kb_hi, kz_ptr, ks_ptr, meta, ch, HALF: tl.constexpr, KBITS: tl.constexpr,
                       LOWP: tl.constexpr):
        """Logits [G, BLOCK] of keys stored after RoPE per channel (``KFOLD``): each channel's scale multiplies the
        query and its minimum becomes one number per query head, so the codes go to the products as they are, as
        128 + code (on a GPU the bits ``0x4300 | code`` read as bfloat16: no conversion; 128 times the scaled
        query's sum taken off); the exact outliers are the caller's (``_outlier_logits``)."""
        z_lo = tl.load(kz_ptr + meta + ch).to(tl.float32)
        z_hi = tl.load(kz_ptr + meta + HALF + ch).to(tl.float32)
        qs_lo = q_lo * tl.load(ks_ptr + meta + ch).to(tl.float32)[None, :]
        qs_hi = q_hi * tl.load(ks_ptr + meta + HALF + ch).to(tl.float32)[None, :]
        c_lo = _unpack(kb_lo, KBITS)
        c_hi = _unpack(kb_hi, KBITS)
        if LOWP:
            qs_lo = qs_lo.to(tl.bfloat16)
            qs_hi = qs_hi.to(tl.bfloat16)
            s = tl.dot(qs_lo, tl.trans(_plus128(c_lo))) + tl.dot(qs_hi, tl.trans(_plus128(c_hi)))
        else:
            s = tl.dot(qs_lo, tl.trans(c_lo.to(tl.float32) + 128.0), input_precision="ieee") + \
                tl.dot(qs_hi, tl.trans(c_hi.to(tl.float32) + 128.0), input_precision="ieee")
        bias = tl.sum(q_lo * z_lo[None, :], 1) + tl.sum(q_hi * z_hi[None, :], 1) - \
            128.0 * (tl.sum(qs_lo.to(tl.float32), 1) + tl.sum(qs_hi.to(tl.float32), 1))
        s = s + bias[:, None]
        return s
