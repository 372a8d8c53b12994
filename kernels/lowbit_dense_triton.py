"""The ``dense`` kernel of the ``lowbit`` decode attention (:func:`kvweave.kernels.lowbit_decode.lowbit_decode`,
``variant="dense"``): keys stored after RoPE in 2- or 4-bit ``channel-group`` codes and 2- or 4-bit values, read as
32-bit words. A word of codes holds ``32 / bits`` channels (channel ``c`` of a token at bit ``(c % per) * bits`` of word
``c // per``, the little-endian reading of the stored bytes), so one load brings 8 or 16 codes and each code costs a
shift and a mask: no byte extraction, no per-code address. Each channel's key scale multiplies the query and its
minimum becomes one number per query head and token group, so key codes go to the products as they are (on a GPU the
bits ``0x4300 | code``, the bfloat16 number 128 + code: no conversion); each value group's scale multiplies the
probabilities. What it does not read (keys before RoPE, 3-bit or ``channel-alloc`` codes, a packed token count that is not
whole steps) the plugin's other kernels read. Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_codes_triton import _level16, _plus128
    from kvweave.kernels.lowbit_triton import _hide, _level, _outlier_logits, _value_scale

    @triton.jit
    def _code(words, k: tl.constexpr, BITS: tl.constexpr):
        """Code ``k`` of each word (a logical shift: the words are read unsigned)."""
        return ((words >> (k * BITS)) & ((1 << BITS) - 1)).to(tl.int32)

    @triton.jit
    def _words_codes(words, BITS: tl.constexpr):
        """int32 words [N, W] of ``BITS``-bit codes (2 or 4) -> int32 codes [N, W * 32 // BITS] in channel order (code
        ``k`` of word ``j`` at column ``j * 32 // BITS + k``): one shift and mask per code. A join adds a last axis,
        the least significant of the column index once reshaped, so the codes are joined innermost by the most
        significant bit of ``k`` (codes ``k`` and ``k + per / 2`` first); joins move no data."""
        if BITS == 4:
            p0 = tl.join(_code(words, 0, 4), _code(words, 4, 4))
            p1 = tl.join(_code(words, 1, 4), _code(words, 5, 4))
            p2 = tl.join(_code(words, 2, 4), _code(words, 6, 4))
            p3 = tl.join(_code(words, 3, 4), _code(words, 7, 4))
            return tl.join(tl.join(p0, p2), tl.join(p1, p3)).reshape(words.shape[0], words.shape[1] * 8)
        else:
            p0 = tl.join(_code(words, 0, 2), _code(words, 8, 2))
            p1 = tl.join(_code(words, 1, 2), _code(words, 9, 2))
            p2 = tl.join(_code(words, 2, 2), _code(words, 10, 2))
            p3 = tl.join(_code(words, 3, 2), _code(words, 11, 2))
            p4 = tl.join(_code(words, 4, 2), _code(words, 12, 2))
            p5 = tl.join(_code(words, 5, 2), _code(words, 13, 2))
            p6 = tl.join(_code(words, 6, 2), _code(words, 14, 2))
            p7 = tl.join(_code(words, 7, 2), _code(words, 15, 2))
            r0 = tl.join(tl.join(p0, p4), tl.join(p2, p6))
            r1 = tl.join(tl.join(p1, p5), tl.join(p3, p7))
            return tl.join(r0, r1).reshape(words.shape[0], words.shape[1] * 16)

    @triton.jit
    def _value_step(acc, corr, pg, alpha, vcodes, vlev_ptr, vlev16_ptr, l0, l1, lut, VBITS: tl.constexpr,
                    LEVELS: tl.constexpr, LOWP: tl.constexpr):
        """One channel group's running output, transposed (``acc`` [VGROUP, G]), and the part of it kept per query row,
        ``corr`` [G] (added once at the end instead of to every channel at every step), after the probabilities ``pg``
        [BLOCK, G] (times the group's scales) meet the value codes [BLOCK, VGROUP]. On a GPU the codes go to the products
        as bfloat16 numbers without a conversion: 2-bit codes shift their level's bfloat16 bits out of one 64-bit word
        (``lut``: the four levels from the low bits, any table), 4-bit uniform levels are ``128 + code`` (``128 x`` the
        operand's sum kept in ``corr``), other 4-bit levels are read from the table's bfloat16 copy. (Selecting among
        bfloat16 constants, as the ``wide`` kernel's ``vb16`` does, and writing the normal levels as two products of
        codes, ``-l1 + b * code + c * (code & 1)``, built to more instructions.)"""
        acc = acc * alpha[None, :]
        corr = corr * alpha
        if LOWP:
            pgb = pg.to(tl.bfloat16)
            if VBITS == 2:  # the four levels' bfloat16 bits, 16 each in one 64-bit word, shifted out by the code
                levels = ((lut >> (vcodes.to(tl.int64) * 16)) & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
                acc = tl.dot(tl.trans(levels), pgb, acc)
            elif LEVELS == 1:  # code - (2**bits - 1) / 2, as 128 + code
                acc = tl.dot(tl.trans(_plus128(vcodes)), pgb, acc)
                corr = corr - (128.0 + ((1 << VBITS) - 1) / 2) * tl.sum(pgb.to(tl.float32), 0)
            else:  # other levels from the table's bfloat16 copy
                acc = tl.dot(tl.trans(tl.load(vlev16_ptr + vcodes)), pgb, acc)
        else:
            acc = tl.dot(tl.trans(_level(vcodes, vlev_ptr, VBITS, LEVELS, l0, l1, False)), pg, acc, input_precision="ieee")
        return acc, corr

    @triton.jit
    def _lowbit_dense_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_ptr, vmax_ptr, vlev_ptr, vlev16_ptr, start_ptr,
        pos_ptr, hid_ptr, m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, first, scaling, l0, l1, lut,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr, LOWP: tl.constexpr,
        LEVELS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr, HAS_POS: tl.constexpr, HID: tl.constexpr,
    ):
        """One program per (batch row x KV head, split of the packed tokens); the split is whole steps of ``BLOCK``
        tokens (``BLOCK`` divides ``KGROUP``), so nothing is masked but slots that are fillers, before the row's first
        visible position, or hidden. Tiles are token-major (logits [BLOCK, G], outputs [channels, G]): the unpacked codes
        are the products' first operand, whose rows (tokens, channels) fill a Hopper warpgroup product of 64 rows, and the
        query heads (padded to 16) the second. Writes the split's running max, sum and output in the rotated space, as
        the ``wide`` kernel does, for the same combine."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        KW: tl.constexpr = D * KBITS // 32  # key words a token
        VW: tl.constexpr = D * VBITS // 32  # value words a token
        GW: tl.constexpr = VGROUP * VBITS // 32  # value words a channel group
        VGROUPS: tl.constexpr = D // VGROUP
        gi = tl.arange(0, G)
        ch = tl.arange(0, D)
        jk = tl.arange(0, KW)
        jv = tl.arange(0, GW)
        cg = tl.arange(0, VGROUP)
        t_loc = tl.arange(0, BLOCK)
        row = bh.to(tl.int64) * tokens
        q_row = q_ptr + bh.to(tl.int64) * G * D
        q = tl.load(q_row + gi[None, :] * D + ch[:, None]) * scaling  # [D, G]
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tokens)
        m_i = tl.full([G], float("-inf"), tl.float32)
        l_i = tl.zeros([G], tl.float32)
        acc0 = tl.zeros([VGROUP, G], tl.float32)  # one accumulator per value channel group (at most 4)
        acc1 = tl.zeros([VGROUP, G], tl.float32)
        acc2 = tl.zeros([VGROUP, G], tl.float32)
        acc3 = tl.zeros([VGROUP, G], tl.float32)
        c0 = tl.zeros([G], tl.float32)  # what each group's output holds per row (_value_step)
        c1 = tl.zeros([G], tl.float32)
        c2 = tl.zeros([G], tl.float32)
        c3 = tl.zeros([G], tl.float32)
        vs_row = vs_ptr + row * VGROUPS  # value scales indexed from the row's first token (log8 maxima by t // VST)
        vmax_row = vmax_ptr + row // VST * VGROUPS
        t_ok = t_loc < BLOCK  # every slot of a step is stored
        for t0 in range(lo, hi, BLOCK):
            tok = row + t0 + t_loc
            meta = (row + t0) // KGROUP * D  # a step lies within one token group
            words = tl.load(kc_ptr + (row + t0) * KW + t_loc[:, None] * KW + jk[None, :]).to(tl.uint32, bitcast=True)
            codes = _words_codes(words, KBITS)  # [BLOCK, D]
            qs = q * tl.load(ks_ptr + meta + ch).to(tl.float32)[:, None]  # [D, G]
            bias = tl.sum(q * tl.load(kz_ptr + meta + ch).to(tl.float32)[:, None], 0)
            if LOWP:  # the operand is 128 + code: 128 times the scaled query's sum taken off
                qs = qs.to(tl.bfloat16)
                s = tl.dot(_plus128(codes), qs)
                bias = bias - 128.0 * tl.sum(qs.to(tl.float32), 0)
            else:
                s = tl.dot(codes.to(tl.float32), qs, input_precision="ieee")
            s = s + bias[None, :]  # [BLOCK, G]
            if KO > 0:  # exact outliers: their code is 0, so the key held the zero point
                s = s + tl.trans(_outlier_logits(q_row, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_ok, gi, scaling, D, KO))
            if HAS_POS:  # a cache that dropped tokens: each slot's cache index (-1: a filler)
                pos = tl.load(pos_ptr + tok).to(tl.int32)
            else:
                pos = first + t0 + t_loc
            if HID > 0:  # slots whose tokens are attended exactly (restored by residuals)
                pos = _hide(pos, t0 + t_loc, hid_ptr + bh * HID, HID)
            visible = pos >= 0
            if HAS_START:
                visible = visible & (pos >= start)
            s = tl.where(visible[:, None], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[None, :])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
            for g in tl.static_range(VGROUPS):  # each channel group's scale folded into the probabilities
                vrow = vc_ptr + (row + t0) * VW + g * GW
                vwords = tl.load(vrow + t_loc[:, None] * VW + jv[None, :]).to(tl.uint32, bitcast=True)
                vcodes = _words_codes(vwords, VBITS)  # [BLOCK, VGROUP]
                pg = p * _value_scale(vs_row, vmax_row, t0 + t_loc, t_ok, g, VGROUPS, VLOG, VST)[:, None]
                if g == 0:
                    acc0, c0 = _value_step(acc0, c0, pg, alpha, vcodes, vlev_ptr, vlev16_ptr, l0, l1, lut, VBITS, LEVELS,
                                           LOWP)
                elif g == 1:
                    acc1, c1 = _value_step(acc1, c1, pg, alpha, vcodes, vlev_ptr, vlev16_ptr, l0, l1, lut, VBITS, LEVELS,
                                           LOWP)
                elif g == 2:
                    acc2, c2 = _value_step(acc2, c2, pg, alpha, vcodes, vlev_ptr, vlev16_ptr, l0, l1, lut, VBITS, LEVELS,
                                           LOWP)
                else:
                    acc3, c3 = _value_step(acc3, c3, pg, alpha, vcodes, vlev_ptr, vlev16_ptr, l0, l1, lut, VBITS, LEVELS,
                                           LOWP)
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + gi, m_i)
        tl.store(l_ptr + out + gi, l_i)
        base = acc_ptr + out.to(tl.int64) * D + gi[None, :] * D + cg[:, None]  # [VGROUP, G]: the outputs transposed
        tl.store(base, acc0 + c0[None, :])
        if VGROUPS > 1:
            tl.store(base + VGROUP, acc1 + c1[None, :])
        if VGROUPS > 2:
            tl.store(base + 2 * VGROUP, acc2 + c2[None, :])
            tl.store(base + 3 * VGROUP, acc3 + c3[None, :])
