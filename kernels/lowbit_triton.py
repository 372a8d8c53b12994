"""The ``@triton.jit`` kernels of the ``lowbit`` decode attention, launched by :func:`kvweave.kernels.lowbit_decode.lowbit_decode`
(which documents what they read). Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_codes_triton import _as_float, _folded_logits, _level16, _unpack

    @triton.jit
    def _stream_codes(row_ptr, t_idx, t_ok, offset, bits, WIDTH: tl.constexpr):
        """Codes [BLOCK, len(offset)] of tokens ``t_idx`` from one little-endian bit stream per token
        (``WIDTH`` bytes): channel ``j``'s code takes ``bits[j]`` bits at bit ``offset[j]``. A code of at most 8
        bits lies within two bytes; the second is read only where the code crosses into it, and a 0-bit
        channel at the stream's end, pointing past it, reads nothing."""
        at = row_ptr + t_idx[:, None] * WIDTH + (offset // 8)[None, :]
        word = tl.load(at, mask=t_ok[:, None] & ((offset // 8) < WIDTH)[None, :], other=0).to(tl.int32)
        crosses = (offset % 8 + bits > 8) & (offset // 8 + 1 < WIDTH)
        word = word | (tl.load(at + 1, mask=t_ok[:, None] & crosses[None, :], other=0).to(tl.int32) << 8)
        return (word >> (offset % 8)[None, :]) & ((1 << bits) - 1)[None, :]

    @triton.jit
    def _codes(row_ptr, t_idx, t_ok, chan, BITS: tl.constexpr, WIDTH: tl.constexpr):
        """Codes of ``BITS`` each (code ``c`` at bit ``c * BITS``); a 3-bit code may cross into the next byte."""
        if 8 % BITS == 0:  # whole codes in each byte
            per: tl.constexpr = 8 // BITS
            byte = tl.load(row_ptr + t_idx[:, None] * WIDTH + (chan // per)[None, :], mask=t_ok[:, None], other=0)
            return (byte.to(tl.int32) >> ((chan % per) * BITS)[None, :]) & ((1 << BITS) - 1)
        return _stream_codes(row_ptr, t_idx, t_ok, chan * BITS, tl.full(chan.shape, BITS, tl.int32), WIDTH)

    @triton.jit
    def _dequant(codes_ptr, zero_ptr, scale_ptr, oi_ptr, ov_ptr, kw_ptr, row_off, t_idx, t_ok, chan,
                 D: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr, KWIDTH: tl.constexpr,
                 VARW: tl.constexpr, KWW: tl.constexpr, MAGIC: tl.constexpr):
        """Keys [BLOCK_T, D] (channel order ``chan``) of tokens ``t_idx``, before the rotary embedding. ``VARW``:
        each channel of the token group has its own width (channel-alloc.v1: ``KWW`` one-byte widths a group as
        stored, channel ``c`` taking width ``c % KWW``), its offset in the token's stream the sum of the widths of
        the channels before it, summed here."""
        group_row = tl.min(t_idx) // KGROUP  # a tile lies within one token group (BLOCK divides KGROUP)
        meta = (row_off // KGROUP) * D + group_row * D + chan
        if VARW:
            every = tl.arange(0, D)
            widths = tl.load(kw_ptr + ((row_off // KGROUP) + group_row) * KWW + every % KWW).to(tl.int32)
            starts = tl.cumsum(widths, 0) - widths
            code = _stream_codes(codes_ptr + row_off * KWIDTH, t_idx, t_ok, tl.gather(starts, chan, 0), tl.gather(widths, chan, 0), KWIDTH)
        else:
            code = _codes(codes_ptr + row_off * KWIDTH, t_idx, t_ok, chan, KBITS, KWIDTH)
        zero = tl.load(zero_ptr + meta).to(tl.float32)
        scale = tl.load(scale_ptr + meta).to(tl.float32)
        keys = zero[None, :] + _as_float(code, MAGIC) * scale[None, :]
        for o in tl.static_range(KO):
            index = tl.load(oi_ptr + row_off * KO + t_idx * KO + o, mask=t_ok, other=0).to(tl.int32)
            value = tl.load(ov_ptr + row_off * KO + t_idx * KO + o, mask=t_ok, other=0.0).to(tl.float32)
            keys = tl.where(index[:, None] == chan[None, :], value[:, None], keys)
        return keys

    @triton.jit
    def _online_step(s, t_ok, pos, start, m_i, HAS_START: tl.constexpr):
        """One tile of the online softmax: the logits ``s`` [G, BLOCK] of the visible slots (in the tile, not a filler,
        at or after the row's first visible position) against the running max ``m_i``: (``p``, the factor ``alpha``
        that rescales what was summed before, the new max)."""
        visible = t_ok & (pos >= 0)
        if HAS_START:
            visible = visible & (pos >= start)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        return tl.exp(s - m_safe[:, None]), tl.exp(m_i - m_safe), m_new

    @triton.jit
    def _hide(pos, slots, hid_row, HID: tl.constexpr):
        """``pos`` with -1 (never attended) at the packed ``slots`` listed in ``hid_row`` [HID] (-1: none)."""
        listed = tl.load(hid_row + tl.arange(0, HID))
        hidden = tl.sum((slots[:, None] == listed[None, :]).to(tl.int32), 1) > 0
        return tl.where(hidden, -1, pos)

    @triton.jit
    def _cos_sin(pos, freq, rope_scale, APPROX: tl.constexpr):
        """cos and sin [BLOCK, len(freq)] of the rotary angles ``pos * freq``, times ``rope_scale``; each angle reduced
        into [-pi, pi] first (their large-argument path is slow): Cody-Waite with 2 pi = 6.28125 + 0.00193530717958647
        (k * 6.28125 exact in float32 for k < 2**15, 200K positions). ``APPROX`` (a GPU build with bfloat16 tile operands):
        the hardware's approximations (``cos.approx``, ``sin.approx``: absolute error about 1e-6 on [-pi, pi], far
        below a bfloat16 operand's rounding) instead of the libm-accurate functions, a few instructions instead of
        dozens per angle."""
        cos, sin = _angle_cos_sin(pos.to(tl.float32)[:, None] * freq[None, :], APPROX)
        return cos * rope_scale, sin * rope_scale

    @triton.jit
    def _angle_cos_sin(angle, APPROX: tl.constexpr):
        """cos and sin of ``angle`` (radians, float32), reduced as :func:`_cos_sin` says."""
        turns = tl.floor(angle * 0.15915494309189535 + 0.5)
        angle = (angle - turns * 6.28125) - turns * 0.0019353071795864769
        if APPROX:
            cos = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True, pack=1)
            sin = tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [angle], dtype=tl.float32, is_pure=True, pack=1)
        else:
            cos, sin = tl.cos(angle), tl.sin(angle)
        return cos, sin

    @triton.jit
    def _outlier_logits(q_row, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_ok, gi, scaling, D: tl.constexpr, KO: tl.constexpr):
        """What the exact outliers add to the logits [G, BLOCK] of keys after RoPE read without them (``KFOLD``): an
        outlier's code is 0, so its key held the channel's zero point; the value's difference from it meets the
        query's entry of its channel, per token instead of per element."""
        for o in tl.static_range(KO):
            index = tl.load(koi_ptr + tok * KO + o, mask=t_ok, other=0).to(tl.int32)
            delta = tl.load(kov_ptr + tok * KO + o, mask=t_ok, other=0.0).to(tl.float32) - \
                tl.load(kz_ptr + meta + index).to(tl.float32)
            part = tl.load(q_row + gi[:, None] * D + index[None, :]).to(tl.float32) * scaling * delta[None, :]
            if o == 0:
                total = part
            else:
                total = total + part
        return total

    @triton.jit
    def _value_scale(vs_row, vmax_row, t_idx, t_ok, group, VGROUPS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr):
        """The value scales of tokens ``t_idx`` (from the row's first token; ``t_ok``: loaded) and channel groups
        ``group``, broadcast together: float16 as stored, or log8 steps ``k`` below each ``VST`` tokens' float16
        maximum."""
        stored = tl.load(vs_row + t_idx * VGROUPS + group, mask=t_ok, other=0).to(tl.float32)
        if VLOG:
            top = tl.load(vmax_row + (t_idx // VST) * VGROUPS + group, mask=t_ok, other=0.0).to(tl.float32)
            return top * tl.exp2(stored * -0.0625)
        return stored

    @triton.jit
    def _lowbit_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, vc_ptr, vs_ptr, vmax_ptr, vlev_ptr, freq_ptr, start_ptr,
        pos_ptr, hid_ptr, m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, first, rope_scale, scaling,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, ROPE: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
        LOWP: tl.constexpr, KWIDTH: tl.constexpr, VARW: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr, APPROX: tl.constexpr,
        HAS_POS: tl.constexpr, KWW: tl.constexpr, HID: tl.constexpr, MAGIC: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        chan = tl.arange(0, D)
        half: tl.constexpr = D // 2
        partner = (chan + half) % D
        sign = tl.where(chan < half, -1.0, 1.0)
        gi = tl.arange(0, G)
        q = tl.load(q_ptr + bh * G * D + gi[:, None] * D + chan[None, :]).to(tl.float32) * scaling
        if ROPE:
            freq = tl.load(freq_ptr + chan % half)
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        m_i = tl.full([G], float("-inf"), tl.float32)
        l_i = tl.zeros([G, BLOCK], tl.float32)  # each slot's running sum of probabilities, summed after the loop
        acc = tl.zeros([G, D], tl.float32)
        row_off = bh.to(tl.int64) * tokens  # 64-bit offsets: B x H x T x width passes 2**31 at long contexts
        v_width: tl.constexpr = D * VBITS // 8
        v_groups: tl.constexpr = D // VGROUP
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tokens)
        for t0 in range(lo, hi, BLOCK):
            t_idx = t0 + tl.arange(0, BLOCK)
            t_ok = t_idx < hi
            keys = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, row_off, t_idx, t_ok, chan, D, KBITS, KGROUP, KO, KWIDTH, VARW, KWW, MAGIC)
            if HAS_POS:  # a cache that dropped tokens: each slot's cache index (-1: a filler)
                pos = tl.load(pos_ptr + row_off + t_idx, mask=t_ok, other=-1).to(tl.int32)
            else:
                pos = first + t_idx
            if ROPE:
                other = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, row_off, t_idx, t_ok, partner, D, KBITS, KGROUP, KO, KWIDTH, VARW, KWW, MAGIC)
                cos, sin = _cos_sin(pos, freq, rope_scale, APPROX)
                keys = keys * cos + sign[None, :] * other * sin
            s = _product(q, tl.trans(keys), LOWP)  # [G, BLOCK]; bfloat16 operands on a GPU, what sdpa over bfloat16 keys computes
            if HID > 0:  # slots whose tokens are attended exactly (restored by residuals)
                pos = _hide(pos, t_idx, hid_ptr + bh * HID, HID)
            p, alpha, m_new = _online_step(s, t_ok, pos, start, m_i, HAS_START)
            code = _codes(vc_ptr + row_off * v_width, t_idx, t_ok, chan, VBITS, v_width)
            level = tl.load(vlev_ptr + code)
            vscale = _value_scale(vs_ptr + row_off * v_groups, vmax_ptr + row_off // VST * v_groups, t_idx[:, None], t_ok[:, None],
                                  (chan // VGROUP)[None, :], v_groups, VLOG, VST)
            values = level * vscale
            acc = acc * alpha[:, None] + _product(p, values, LOWP)
            l_i = l_i * alpha[:, None] + p
            m_i = m_new
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + gi, m_i)
        tl.store(l_ptr + out + gi, tl.sum(l_i, 1))
        tl.store(acc_ptr + out * D + gi[:, None] * D + chan[None, :], acc)

    @triton.jit
    def _level(code, vlev_ptr, VBITS: tl.constexpr, LEVELS: tl.constexpr, l0, l1, MAGIC: tl.constexpr):
        """The value level of each code (:func:`kvweave.kernels.lowbit_decode.level_kind`): arithmetic where the
        levels allow it, else a load from the table."""
        if LEVELS == 1:  # uniform, symmetric: code - (2**bits - 1) / 2
            return _as_float(code, MAGIC) - ((1 << VBITS) - 1) / 2
        elif LEVELS == 2:  # the four normal levels -l1, -l0, l0, l1
            return tl.where(code >= 2, 1.0, -1.0) * tl.where((code == 0) | (code == 3), l1, l0)
        else:
            return tl.load(vlev_ptr + code)

    @triton.jit
    def _product(a, b, LOWP: tl.constexpr):
        """``a @ b`` on the tensor cores: bfloat16 operands and float32 sums on a GPU (``LOWP`` 1), float32 operands
        on TF32 (``LOWP`` 2: no conversion, 10-bit mantissas), float32 otherwise."""
        if LOWP == 2:
            return tl.dot(a, b, input_precision="tf32")
        elif LOWP:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def _accumulate(acc0, acc1, acc2, acc3, part, alpha, R: tl.constexpr):
        """The running outputs with ``part`` added to accumulator ``R`` (of at most four), each rescaled by ``alpha``
        where it takes a part."""
        if R == 0:
            acc0 = acc0 * alpha[:, None] + part
        elif R == 1:
            acc1 = acc1 * alpha[:, None] + part
        elif R == 2:
            acc2 = acc2 * alpha[:, None] + part
        else:
            acc3 = acc3 * alpha[:, None] + part
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _wide_bytes(kc_row, pos_row, t_loc, t_ok, jb, first, NB: tl.constexpr, KWIDTH: tl.constexpr, HAS_POS: tl.constexpr):
        """The packed key bytes of one step (each half of the head [BLOCK, NB]) and the slots' positions."""
        kb_lo = tl.load(kc_row + t_loc[:, None] * KWIDTH + jb[None, :], mask=t_ok[:, None], other=0)
        kb_hi = tl.load(kc_row + t_loc[:, None] * KWIDTH + NB + jb[None, :], mask=t_ok[:, None], other=0)
        if HAS_POS:
            pos = tl.load(pos_row + t_loc, mask=t_ok, other=-1).to(tl.int32)
        else:
            pos = first + t_loc
        return kb_lo, kb_hi, pos

    @triton.jit
    def _lowbit_wide_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, vc_ptr, vs_ptr, vmax_ptr, vlev_ptr, freq_ptr, start_ptr,
        pos_ptr, hid_ptr, m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, first, rope_scale, scaling, l0, l1, vlev16_ptr,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, ROPE: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
        LOWP: tl.constexpr, LEVELS: tl.constexpr, KWIDTH: tl.constexpr, VARW: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr,
        APPROX: tl.constexpr,
        HAS_POS: tl.constexpr, KWW: tl.constexpr, HID: tl.constexpr, FASTK: tl.constexpr, FASTV: tl.constexpr,
        MAGIC: tl.constexpr, VB16: tl.constexpr, KTF32: tl.constexpr, KFOLD: tl.constexpr,
    ):
        """Whole tiles: each half of the head's keys dequantized in one piece and rotated pairwise (one product per
        half a step; the query loaded once), and the values one product per channel group (at most 4) whose scale
        multiplies the probabilities (a number per token) instead of every value. ``FASTK`` (2- or 4-bit
        ``channel-group`` keys): the codes unpacked from their bytes by interleaving in registers, the next step's
        bytes loaded before this step's arithmetic; otherwise (3 bits, ``channel-alloc`` widths) each code read from
        the one or two bytes it lies in. ``FASTV`` (2- or 4-bit values): likewise, else byte-read codes. Conversions
        left out (:data:`kvweave.kernels.lowbit_decode.TRICKS`): ``MAGIC`` codes made float by their bits, ``VB16``
        value operands made bfloat16 without a conversion, ``KTF32`` the keys' products on TF32, ``KFOLD`` (keys after
        RoPE) each channel's scale and minimum folded into the query (:func:`_folded_logits`), the exact outliers added to
        the logits per token (:func:`_outlier_logits`)."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        HALF: tl.constexpr = D // 2
        VW: tl.constexpr = D * VBITS // 8  # bytes of a value
        VGROUPS: tl.constexpr = D // VGROUP
        NVG: tl.constexpr = VGROUP * VBITS // 8  # bytes of one channel group of a value
        gi = tl.arange(0, G)
        if FASTV:
            jg = tl.arange(0, NVG)
        ch = tl.arange(0, HALF)
        cg = tl.arange(0, VGROUP)
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        row = bh.to(tl.int64) * tokens
        q_row = q_ptr + bh.to(tl.int64) * G * D
        q_lo = tl.load(q_row + gi[:, None] * D + ch[None, :]) * scaling
        q_hi = tl.load(q_row + gi[:, None] * D + HALF + ch[None, :]) * scaling
        t_loc = tl.arange(0, BLOCK)
        if VB16:  # the normal levels and their negations as bfloat16 scalars
            b0 = l0.to(tl.bfloat16)
            b1 = l1.to(tl.bfloat16)
            n0 = (-l0).to(tl.bfloat16)
            n1 = (-l1).to(tl.bfloat16)
        if ROPE:
            freq = tl.load(freq_ptr + ch)
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tokens)
        m_i = tl.full([G], float("-inf"), tl.float32)
        l_i = tl.zeros([G, BLOCK], tl.float32)  # each slot's running sum of probabilities, summed after the loop
        acc0 = tl.zeros([G, VGROUP], tl.float32)  # one accumulator per channel group (at most 4)
        acc1 = tl.zeros([G, VGROUP], tl.float32)
        acc2 = tl.zeros([G, VGROUP], tl.float32)
        acc3 = tl.zeros([G, VGROUP], tl.float32)
        if FASTK:
            NB: tl.constexpr = HALF // (8 // KBITS)  # bytes of a half-head of keys
            jb = tl.arange(0, NB)
            kb_lo, kb_hi, pos = _wide_bytes(kc_ptr + (row + lo) * KWIDTH, pos_ptr + row + lo, t_loc, lo + t_loc < hi, jb,
                                            first + lo, NB, KWIDTH, HAS_POS)
        for t0 in range(lo, hi, BLOCK):
            t_ok = t0 + t_loc < hi
            vc_row = vc_ptr + (row + t0) * VW
            if FASTK:
                nxt = t0 + BLOCK  # the next step's bytes, in flight while this step computes
                n_lo, n_hi, n_pos = _wide_bytes(kc_ptr + (row + nxt) * KWIDTH, pos_ptr + row + nxt, t_loc, nxt + t_loc < hi, jb,
                                                first + nxt, NB, KWIDTH, HAS_POS)
                meta = (row + t0) // KGROUP * D  # a tile lies within one token group
                if not KFOLD:
                    k_lo = tl.load(kz_ptr + meta + ch).to(tl.float32)[None, :] + \
                        _as_float(_unpack(kb_lo, KBITS), MAGIC) * tl.load(ks_ptr + meta + ch).to(tl.float32)[None, :]
                    k_hi = tl.load(kz_ptr + meta + HALF + ch).to(tl.float32)[None, :] + \
                        _as_float(_unpack(kb_hi, KBITS), MAGIC) * tl.load(ks_ptr + meta + HALF + ch).to(tl.float32)[None, :]
                    for o in tl.static_range(KO):
                        index = tl.load(koi_ptr + (row + t0 + t_loc) * KO + o, mask=t_ok, other=0).to(tl.int32)
                        value = tl.load(kov_ptr + (row + t0 + t_loc) * KO + o, mask=t_ok, other=0.0).to(tl.float32)
                        k_lo = tl.where(index[:, None] == ch[None, :], value[:, None], k_lo)
                        k_hi = tl.where(index[:, None] == (ch + HALF)[None, :], value[:, None], k_hi)
            else:
                k_lo = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, row, t0 + t_loc, t_ok, ch, D, KBITS, KGROUP, KO,
                                KWIDTH, VARW, KWW, MAGIC)
                k_hi = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, kw_ptr, row, t0 + t_loc, t_ok, ch + HALF, D, KBITS, KGROUP,
                                KO, KWIDTH, VARW, KWW, MAGIC)
                if HAS_POS:
                    pos = tl.load(pos_ptr + row + t0 + t_loc, mask=t_ok, other=-1).to(tl.int32)
                else:
                    pos = first + t0 + t_loc
            if ROPE:
                cos, sin = _cos_sin(pos, freq, rope_scale, APPROX)
                k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
            if KFOLD:
                s = _folded_logits(q_lo, q_hi, kb_lo, kb_hi, kz_ptr, ks_ptr, meta, ch, HALF, KBITS, LOWP)
            elif KTF32:
                s = _product(q_lo, tl.trans(k_lo), 2) + _product(q_hi, tl.trans(k_hi), 2)
            else:
                s = _product(q_lo, tl.trans(k_lo), LOWP) + _product(q_hi, tl.trans(k_hi), LOWP)
            if KFOLD and KO > 0:
                s = s + _outlier_logits(q_row, kz_ptr, koi_ptr, kov_ptr, meta, row + t0 + t_loc, t_ok, gi, scaling, D, KO)
            if HID > 0:  # slots whose tokens are attended exactly (restored by residuals)
                pos = _hide(pos, t0 + t_loc, hid_ptr + bh * HID, HID)
            p, alpha, m_new = _online_step(s, t_ok, pos, start, m_i, HAS_START)
            l_i = l_i * alpha[:, None] + p
            m_i = m_new
            vs_row = vs_ptr + row * VGROUPS  # scales indexed from the row's first token (log8 maxima by t // VST)
            vmax_row = vmax_ptr + row // VST * VGROUPS
            for g in tl.static_range(VGROUPS):  # each channel group's scale folded into the probabilities
                if FASTV:
                    vb = tl.load(vc_row + t_loc[:, None] * VW + g * NVG + jg[None, :], mask=t_ok[:, None], other=0)
                    code = _unpack(vb, VBITS)
                else:
                    code = _codes(vc_ptr + row * VW, t0 + t_loc, t_ok, g * VGROUP + cg, VBITS, VW)
                pg = p * _value_scale(vs_row, vmax_row, t0 + t_loc, t_ok, g, VGROUPS, VLOG, VST)[None, :]
                if VB16:  # bfloat16 operands made without converting a value
                    pgb = pg.to(tl.bfloat16)
                    part = tl.dot(pgb, _level16(code, vlev16_ptr, LEVELS, b0, b1, n0, n1))
                    if LEVELS == 1:  # the operand was 128 + code
                        part = part - (128.0 + ((1 << VBITS) - 1) / 2) * tl.sum(pgb.to(tl.float32), 1)[:, None]
                else:
                    part = _product(pg, _level(code, vlev_ptr, VBITS, LEVELS, l0, l1, MAGIC), LOWP)  # [G, VGROUP]
                acc0, acc1, acc2, acc3 = _accumulate(acc0, acc1, acc2, acc3, part, alpha, g)
            if FASTK:
                kb_lo, kb_hi, pos = n_lo, n_hi, n_pos
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + gi, m_i)
        tl.store(l_ptr + out + gi, tl.sum(l_i, 1))
        base = acc_ptr + out.to(tl.int64) * D + gi[:, None] * D + cg[None, :]
        tl.store(base, acc0)
        if VGROUPS > 1:
            tl.store(base + VGROUP, acc1)
        if VGROUPS > 2:
            tl.store(base + 2 * VGROUP, acc2)
            tl.store(base + 3 * VGROUP, acc3)

    # the combine pass (one program per query head, or per KV head) lives beside: kernels/lowbit_combine_triton.py
    from kvweave.kernels.lowbit_combine_triton import (_lowbit_combine_group_kernel, _lowbit_combine_kernel,  # noqa: E402,F401
                                                       _merge_tokens)
