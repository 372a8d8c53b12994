"""Keys stored before the rotary embedding in the ``dense`` kernel (:mod:`kvweave.kernels.lowbit_dense_triton`,
``ROPE``): a step's 2- or 4-bit ``channel-group`` codes read as 32-bit words ``PC`` rotary pairs at a time (channels
``i0 ..`` and ``D / 2 + i0 ..``, the pairs of Llama-style models; each part's tiles dead before the next's are made),
dequantized by their channels' scales and zero points, rotated at each slot's position in registers (``r_lo = k_lo
cos - k_hi sin``, ``r_hi = k_hi cos + k_lo sin``, the angles ``position * inv_freq``) and met by the query's rows of
the part in two tensor-core products; each exact outlier then adds its rotated difference from the zero point per
slot. On a GPU (``ASM``) the keys are float16 and the cosines and sines the hardware's approximations after a
reduction into [-pi, pi] (:func:`kvweave.kernels.lowbit_triton._angle_cos_sin`); under the interpreter float32
throughout. The rotary embedding's ``rope_scale`` multiplies the query instead of every cosine and sine. Without
triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_rows_triton import _words_codes
    from kvweave.kernels.lowbit_triton import _angle_cos_sin

    @triton.jit
    def _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, c0: tl.constexpr, PC: tl.constexpr, KW: tl.constexpr,
                   KBITS: tl.constexpr, LOWP: tl.constexpr):
        """A step's keys [BLOCK, PC] at channels ``c0 .. c0 + PC`` (whole words), dequantized: ``kstep`` the step's
        first word, ``meta`` its token group's first scale."""
        per: tl.constexpr = 32 // KBITS  # codes a word
        jh = tl.arange(0, PC // per)
        words = tl.load(kstep + t_loc[:, None] * KW + c0 // per + jh[None, :]).to(tl.uint32, bitcast=True)
        codes = _words_codes(words, KBITS)  # [BLOCK, PC] in channel order
        hc = c0 + tl.arange(0, PC)
        scale = tl.load(ks_ptr + meta + hc)
        zero = tl.load(kz_ptr + meta + hc)
        if LOWP:  # the code in the mantissa of float16 1024 (no conversion), 1024 taken off exactly
            value = (codes | 0x6400).to(tl.int16).to(tl.float16, bitcast=True) - 1024.0
            keys = zero.to(tl.float16)[None, :] + value * scale.to(tl.float16)[None, :]
        else:
            keys = zero.to(tl.float32)[None, :] + codes.to(tl.float32) * scale.to(tl.float32)[None, :]
        return keys

    @triton.jit
    def _part_queries(q_row, gi, factor, c0: tl.constexpr, PC: tl.constexpr, D: tl.constexpr, LOWP: tl.constexpr):
        """The query rows [PC, G] at channels ``c0 .. c0 + PC`` (columns ``gi``), times ``factor``; float16 with
        ``LOWP`` (the products' second operands)."""
        q = tl.load(q_row + gi[None, :] * D + (c0 + tl.arange(0, PC))[:, None]).to(tl.float32) * factor
        if LOWP:
            q = q.to(tl.float16)
        return q

    @triton.jit
    def _part_logits(kstep, ks_ptr, kz_ptr, meta, t_loc, pos, freq_ptr, q_row, gi, factor, i0: tl.constexpr,
                     PC: tl.constexpr, KW: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, LOWP: tl.constexpr,
                     ASM: tl.constexpr):
        """What the rotary pairs ``i0 .. i0 + PC`` (channels ``i0 ..`` and ``D / 2 + i0 ..``) add to a step's logits
        [BLOCK, G]: the cosines and sines first, then the keys, so that the float32 angles are dead before the keys
        live."""
        cos, sin = _angle_cos_sin(pos.to(tl.float32)[:, None] * tl.load(freq_ptr + i0 + tl.arange(0, PC))[None, :],
                                  ASM > 0)
        dtype: tl.constexpr = tl.float16 if LOWP else tl.float32
        cos, sin = cos.to(dtype), sin.to(dtype)
        k_lo = _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, i0, PC, KW, KBITS, LOWP)
        k_hi = _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, D // 2 + i0, PC, KW, KBITS, LOWP)
        r_lo = k_lo * cos - k_hi * sin
        r_hi = k_hi * cos + k_lo * sin
        q_lo = _part_queries(q_row, gi, factor, i0, PC, D, LOWP)
        q_hi = _part_queries(q_row, gi, factor, D // 2 + i0, PC, D, LOWP)
        if LOWP:
            s = tl.dot(r_lo, q_lo) + tl.dot(r_hi, q_hi)
        else:
            s = tl.dot(r_lo, q_lo, input_precision="ieee") + tl.dot(r_hi, q_hi, input_precision="ieee")
        return s

    @triton.jit
    def _rope_logits(kstep, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q_row, gi, factor,
                     KW: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, KO: tl.constexpr, LOWP: tl.constexpr,
                     ASM: tl.constexpr, PC: tl.constexpr):
        """A step's logits [BLOCK, G] of keys stored before RoPE, rotated at ``pos`` [BLOCK] (each slot's position; a
        filler's is never attended) by the frequencies at ``freq_ptr`` [D / 2], ``PC`` rotary pairs at a time (at
        head_dim 128 and 64-token steps the whole step's float32 angles, cosines and sines spilled 136 bytes a thread at
        128 registers, sm_90 build), then the exact outliers (:func:`_rotated_outlier`); ``tok``: the slots' indices
        from the row's first token (the outliers' rows); the query's rows ``q_row`` at columns ``gi``, times
        ``factor`` (the softmax's scaling and the rotary embedding's ``rope_scale``)."""
        s = _part_logits(kstep, ks_ptr, kz_ptr, meta, t_loc, pos, freq_ptr, q_row, gi, factor, 0, PC, KW, D, KBITS, LOWP,
                         ASM)
        for i0 in tl.static_range(PC, D // 2, PC):
            s += _part_logits(kstep, ks_ptr, kz_ptr, meta, t_loc, pos, freq_ptr, q_row, gi, factor, i0, PC, KW, D, KBITS,
                              LOWP, ASM)
        for o in tl.static_range(KO):
            s += _rotated_outlier(q_row, kz_ptr, koi_ptr, kov_ptr, freq_ptr, meta, tok, pos, gi, factor, o, D, KO, ASM)
        return s

    @triton.jit
    def _rotated_outlier(q_row, kz_ptr, koi_ptr, kov_ptr, freq_ptr, meta, tok, pos, gi, factor, o: tl.constexpr,
                         D: tl.constexpr, KO: tl.constexpr, ASM: tl.constexpr):
        """What exact outlier ``o`` of each slot adds to its logits [BLOCK, G]: its code is 0, so the dequantized key
        held the channel's zero point there, and the difference ``delta`` rotates with the channel's pair: channel ``c``
        of the first half adds ``delta (cos q[c] + sin q[c + D / 2])``, of the second ``delta (cos q[c] - sin
        q[c - D / 2])`` (the query rows at ``q_row``, times ``factor``), per slot instead of per element."""
        index = tl.load(koi_ptr + tok * KO + o).to(tl.int32)
        delta = tl.load(kov_ptr + tok * KO + o).to(tl.float32) - tl.load(kz_ptr + meta + index).to(tl.float32)
        upper = index >= D // 2
        partner = tl.where(upper, index - D // 2, index + D // 2)
        cos, sin = _angle_cos_sin(pos.to(tl.float32) * tl.load(freq_ptr + index % (D // 2)), ASM > 0)
        sin = tl.where(upper, -sin, sin)
        q_at = tl.load(q_row + gi[None, :] * D + index[:, None]).to(tl.float32)
        q_partner = tl.load(q_row + gi[None, :] * D + partner[:, None]).to(tl.float32)
        return (delta * factor)[:, None] * (cos[:, None] * q_at + sin[:, None] * q_partner)
