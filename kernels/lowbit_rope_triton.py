"""Keys stored before the rotary embedding in the ``dense`` kernel (:mod:`kvweave.kernels.lowbit_dense_triton`,
``ROPE``): a step's 2- or 4-bit ``channel-group`` codes read as 32-bit words in two halves (channels ``0 .. D / 2``
and ``D / 2 .. D``, the rotary pairs of Llama-style models), dequantized by their channels' scales and zero points,
the exact outliers put in place, rotated at each slot's position in registers (``r_lo = k_lo cos - k_hi sin``,
``r_hi = k_hi cos + k_lo sin``, the angles ``position * inv_freq``) and met by the query's two halves in two
tensor-core products. On a GPU (``ASM``) the halves are float16 and the cosines and sines the hardware's
approximations after a reduction into [-pi, pi] (:func:`kvweave.kernels.lowbit_triton._cos_sin`); under the
interpreter float32 throughout. The rotary embedding's ``rope_scale`` multiplies the query once instead of every
cosine and sine. Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_rows_triton import _words_codes
    from kvweave.kernels.lowbit_triton import _cos_sin

    @triton.jit
    def _rope_queries(q_row, scaling, rope_scale, gi, part: tl.constexpr, D: tl.constexpr, LOWP: tl.constexpr):
        """The query rows of part ``part`` (0 or 1) of the rotary pairs for the first and the second half of the
        channels, [D / 4, G] each, times ``scaling`` and ``rope_scale``; float16 with ``LOWP`` (the products'
        second operands)."""
        hc = part * (D // 4) + tl.arange(0, D // 4)
        factor = scaling * rope_scale
        q_lo = tl.load(q_row + gi[None, :] * D + hc[:, None]).to(tl.float32) * factor
        q_hi = tl.load(q_row + gi[None, :] * D + D // 2 + hc[:, None]).to(tl.float32) * factor
        if LOWP:
            q_lo, q_hi = q_lo.to(tl.float16), q_hi.to(tl.float16)
        return q_lo, q_hi

    @triton.jit
    def _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, c0: tl.constexpr, KW: tl.constexpr, D: tl.constexpr,
                   KBITS: tl.constexpr, LOWP: tl.constexpr):
        """A step's keys [BLOCK, D / 4] at channels ``c0 .. c0 + D / 4`` (whole words), dequantized: ``kstep`` the
        step's first word, ``meta`` its token group's first scale."""
        per: tl.constexpr = 32 // KBITS  # codes a word
        jh = tl.arange(0, D // 4 // per)
        words = tl.load(kstep + t_loc[:, None] * KW + c0 // per + jh[None, :]).to(tl.uint32, bitcast=True)
        codes = _words_codes(words, KBITS)  # [BLOCK, D / 4] in channel order
        hc = c0 + tl.arange(0, D // 4)
        scale = tl.load(ks_ptr + meta + hc)
        zero = tl.load(kz_ptr + meta + hc)
        if LOWP:
            keys = zero.to(tl.float16)[None, :] + codes.to(tl.float16) * scale.to(tl.float16)[None, :]
        else:
            keys = zero.to(tl.float32)[None, :] + codes.to(tl.float32) * scale.to(tl.float32)[None, :]
        return keys

    @triton.jit
    def _part_logits(kstep, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q_lo, q_hi,
                     part: tl.constexpr, KW: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, KO: tl.constexpr,
                     LOWP: tl.constexpr, ASM: tl.constexpr):
        """What part ``part`` (0 or 1) of the rotary pairs adds to a step's logits [BLOCK, G]."""
        hc = part * (D // 4) + tl.arange(0, D // 4)
        k_lo = _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, part * (D // 4), KW, D, KBITS, LOWP)
        k_hi = _part_keys(kstep, ks_ptr, kz_ptr, meta, t_loc, D // 2 + part * (D // 4), KW, D, KBITS, LOWP)
        if KO > 0:  # exact outliers in place of their channels' codes, before the rotation
            for o in tl.static_range(KO):
                index = tl.load(koi_ptr + tok * KO + o).to(tl.int32)
                value = tl.load(kov_ptr + tok * KO + o).to(k_lo.dtype)
                k_lo = tl.where(index[:, None] == hc[None, :], value[:, None], k_lo)
                k_hi = tl.where(index[:, None] == hc[None, :] + D // 2, value[:, None], k_hi)
        cos, sin = _cos_sin(pos, tl.load(freq_ptr + hc), 1.0, ASM > 0)
        cos, sin = cos.to(k_lo.dtype), sin.to(k_lo.dtype)
        r_lo = k_lo * cos - k_hi * sin
        r_hi = k_hi * cos + k_lo * sin
        if LOWP:
            s = tl.dot(r_lo, q_lo) + tl.dot(r_hi, q_hi)
        else:
            s = tl.dot(r_lo, q_lo, input_precision="ieee") + tl.dot(r_hi, q_hi, input_precision="ieee")
        return s

    @triton.jit
    def _rope_logits(kstep, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q0_lo, q0_hi, q1_lo,
                     q1_hi, KW: tl.constexpr, D: tl.constexpr, KBITS: tl.constexpr, KO: tl.constexpr, LOWP: tl.constexpr,
                     ASM: tl.constexpr):
        """A step's logits [BLOCK, G] of keys stored before RoPE, rotated at ``pos`` [BLOCK] (each slot's position; a
        filler's is never attended) by the frequencies at ``freq_ptr`` [D / 2], the pairs in two parts (each part's
        tiles dead before the next's are made: at head_dim 128 and 64-token steps the whole step's float32 angles,
        cosines and sines spilled 136 bytes a thread at 128 registers, sm_90 build); ``tok``: the slots' indices
        from the row's first token (the outliers' rows); ``q<part>_lo`` / ``_hi``: :func:`_rope_queries`."""
        s = _part_logits(kstep, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q0_lo, q0_hi, 0, KW,
                         D, KBITS, KO, LOWP, ASM)
        s += _part_logits(kstep, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q1_lo, q1_hi, 1, KW,
                          D, KBITS, KO, LOWP, ASM)
        return s
