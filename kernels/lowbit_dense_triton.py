"""The ``dense`` kernel of the ``lowbit`` decode attention (:func:`kvweave.kernels.lowbit_decode.lowbit_decode`,
``variant="dense"``): keys in 2- or 4-bit ``channel-group`` codes and 2- or 4-bit values, read as 32-bit words; keys
stored before RoPE are dequantized and rotated at each slot's position in registers (``ROPE``,
:mod:`kvweave.kernels.lowbit_rope_triton`), those stored after it go to the products as codes. A word of codes holds
``32 / bits`` channels (channel ``c`` of a token at bit ``(c % per) * bits`` of word ``c // per``, the little-endian
reading of the stored bytes), so one load brings 8 or 16 codes and each code costs a shift and a mask: no byte extraction, no per-code address. Each channel's key scale multiplies the query and its
minimum becomes one number per query head and token group, so key codes go to the products as they are (on a GPU the
bits ``0x4300 | code``, the bfloat16 number 128 + code: no conversion); each value group's scale multiplies the
probabilities. Value codes become the products' operands two to a 32-bit register, in the order their bits give them
(the output's channels put back when it is stored): from tiles (:mod:`kvweave.kernels.lowbit_tile_triton`) or token by
token (:mod:`kvweave.kernels.lowbit_rows_triton`). The softmax runs against a fixed reference, the first step's largest
logit, with a second pass where the logits rose too far above it (``FIX``), or against a running maximum. What it does
not read (3-bit or ``channel-alloc`` codes, a packed token count that is not whole steps) the
plugin's other kernels read. Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.grid_dependency_triton import gdc_launch_dependents
    from kvweave.kernels.lowbit_codes_triton import _plus128
    from kvweave.kernels.lowbit_rope_triton import _rope_logits
    from kvweave.kernels.lowbit_rows_triton import _pair_channels, _quad_channels, _value_step, _words_codes
    from kvweave.kernels.lowbit_step_triton import (_over, _plane_dots, _plane_fold, _plane_queries, _scale_of,
                                                     _softmax_step, _step_loads)
    from kvweave.kernels.lowbit_tile_triton import _operand, _tile_value_step, _tile_words
    from kvweave.kernels.lowbit_triton import _hide, _outlier_logits
    from kvweave.kernels.prefetch_triton import BULK_PREFETCH, _prefetch_step
    from kvweave.kernels.timeline_triton import _begin_stamp, _end_stamp


    @triton.jit
    def _group_step(acc, pg, alpha, vstep, g: tl.constexpr, a0, a1, b0, b1, t_loc, jv, lut, vlev_ptr, vlev16_ptr, l0, l1,
                    VW: tl.constexpr, GW: tl.constexpr, VBITS: tl.constexpr, LEVELS: tl.constexpr, LOWP: tl.constexpr,
                    ASM: tl.constexpr, VTILE: tl.constexpr, VAH: tl.constexpr):
        """Value channel group ``g``'s running output after a step's probabilities ``pg`` (times its scales): from the
        step's tile (``VTILE``, :func:`_tile_value_step`; with ``VAH`` its words ``a0 .. b1`` loaded a step before, else
        loaded here) or from its token-major words (:func:`_value_step`)."""
        if VTILE:
            if not VAH:
                a0, a1, b0, b1 = _tile_words(vstep, g, VBITS)
            acc = _tile_value_step(acc, pg, alpha, a0, a1, b0, b1, lut, vlev_ptr, vlev16_ptr, VBITS, LEVELS, LOWP, ASM)
        else:
            vwords = tl.load(vstep + g * GW + t_loc[:, None] * VW + jv[None, :]).to(tl.uint32, bitcast=True)
            acc = _value_step(acc, pg, alpha, vwords, lut, vlev_ptr, vlev16_ptr, l0, l1, VBITS, LEVELS, LOWP, ASM)
        return acc

    @triton.jit
    def _ahead_words(t0, kc_ptr, vc_ptr, t_loc, jk, KW: tl.constexpr, VW: tl.constexpr, VBITS: tl.constexpr,
                     KAH: tl.constexpr, VAH: tl.constexpr):
        """Step ``t0``'s codes loaded before the step that reads them: its key words [BLOCK, KW] with ``KAH``, its
        value tile's words for channel groups 0 and 1 (:func:`_tile_words`) with ``VAH``; zeros for what is not."""
        kwords = 0
        if KAH:
            kwords = tl.load(kc_ptr + t0 * KW + t_loc[:, None] * KW + jk[None, :]).to(tl.uint32, bitcast=True)
        u0, u1, u2, u3, w0, w1, w2, w3 = 0, 0, 0, 0, 0, 0, 0, 0
        if VAH:
            u0, u1, u2, u3 = _tile_words(vc_ptr + t0 * VW, 0, VBITS)
            w0, w1, w2, w3 = _tile_words(vc_ptr + t0 * VW, 1, VBITS)
        return kwords, u0, u1, u2, u3, w0, w1, w2, w3

    @triton.jit
    def _value_channels(cg, VBITS: tl.constexpr, LEVELS: tl.constexpr, VTILE: tl.constexpr):
        """The channel of each row of :func:`_value_step`'s accumulator (:func:`_tile_value_step`'s: in order)."""
        channels = cg  # in order: tiles, and 4-bit codes through the table
        if not VTILE and VBITS == 2:
            channels = _quad_channels(cg)
        elif not VTILE and LEVELS == 1:
            channels = _pair_channels(cg)
        return channels

    @triton.jit
    def _pair(x0, x1, PAD: tl.constexpr):
        """With ``PAD`` = 2, tiles [N, R] ``x0`` and ``x1`` side by side as one [N, 2 R], column ``2 r + i`` holding
        column ``r`` of ``x<i>`` (a relabelling of each thread's registers); else ``x0``."""
        if PAD == 2:
            out = tl.join(x0, x1).reshape(x0.shape[0], 2 * x0.shape[1])
        else:
            out = x0
        return out

    @triton.jit
    def _half(x, i: tl.constexpr, PAD: tl.constexpr):
        """With ``PAD`` = 2, the columns ``2 r + i`` of ``x`` [N, 2 R] as [N, R] (:func:`_pair` undone); else ``x``."""
        if PAD == 2:
            even, odd = tl.split(x.reshape(x.shape[0], x.shape[1] // 2, 2))
            if i == 0:
                out = even
            else:
                out = odd
        else:
            out = x
        return out

    @triton.jit
    def _level_table(vlev16_ptr):
        """The 2-bit values' byte-permute table (:func:`_lut_tiles`, the four levels' bfloat16 bits, code 0's lowest) as
        an int64 read from the levels: as a kernel argument, a copy into a register before every permute (32 a step)."""
        table = vlev16_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        return (tl.load(table + 1).to(tl.int64) << 32) | (tl.load(table).to(tl.int64) & 0xFFFFFFFF)

    @triton.jit
    def _probabilities(pg, LOWP: tl.constexpr, ASM: tl.constexpr, VTILE: tl.constexpr):
        """A value product's second operand: the probabilities ``pg`` (times a group's scales), bfloat16 with ``LOWP``;
        with tiles behind :func:`kvweave.kernels.lowbit_tile_triton._operand`, once for the groups sharing it."""
        if LOWP:
            pg = pg.to(tl.bfloat16)
            if VTILE:
                pg = _operand(pg, ASM)
        return pg

    @triton.jit
    def _steps(t_lo, t_hi, m_i, l_i, w_i, acc0, acc1, acc2, acc3, q, q_row, bh, start, first, scaling, l0, l1,
               kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr, hid_ptr,
               freq_ptr, rope_scale, D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
               VBITS: tl.constexpr, VGROUP: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
               LOWP: tl.constexpr, LEVELS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr, HAS_POS: tl.constexpr,
               HID: tl.constexpr, HIDE: tl.constexpr, ASM: tl.constexpr, KPLANES: tl.constexpr, KPF: tl.constexpr,
               AHEAD: tl.constexpr, VTILE: tl.constexpr, PAD: tl.constexpr, QG: tl.constexpr, top, probe, t_first, FIX: tl.constexpr,
               ROPE: tl.constexpr, ROPE_PAIRS: tl.constexpr):
        """The packed pass over steps ``t_lo .. t_hi`` of a program's tokens: its running maximum (or reference), sums
        and outputs carried on; ``HIDE``: these steps hold hidden slots (the list is checked in them only, so the steps without keep the
        code of a storage that hides none). Each step's scales, zero points and positions are loaded a step ahead
        (:func:`_step_loads`; the last step's loads re-read it): loaded where they are used, their latency stalled the
        warps most (Nsight Compute, B = 128 at 64K: a quarter of the stall samples). ``PAD`` = 2: the tile's query
        rows are the real ones twice (column ``2 r + i``: row ``r``), so the softmax runs on the real half alone and
        one tile of probabilities serves two value groups (:func:`_pair`: group ``g`` meets the columns ``2 r + g %
        2``), one shared-memory store and two barriers a step fewer. ``FIX``: the probabilities against a fixed
        reference (:func:`kvweave.kernels.lowbit_step_triton._softmax_step`; ``top``: each slot's largest logit).
        ``AHEAD``: bit 0 the key words and bit 1 the value tiles' words loaded a step ahead, ``AHEAD // 4`` the steps
        ahead whose codes are asked of the L2 cache (a GPU build's, :mod:`kvweave.kernels.prefetch_triton`). ``ROPE``: keys
        stored before RoPE, rotated at each slot's position by the frequencies at ``freq_ptr``
        (:func:`kvweave.kernels.lowbit_rope_triton._rope_logits`)."""
        KW: tl.constexpr = D * KBITS // 32  # key words a token
        VW: tl.constexpr = D * VBITS // 32  # value words a token
        GW: tl.constexpr = VGROUP * VBITS // 32  # value words a channel group
        VGROUPS: tl.constexpr = D // VGROUP
        gi = tl.minimum(tl.arange(0, G) // PAD, QG - 1)  # the query head of each tile column (padding: the last one's)
        ch = tl.arange(0, D)
        jk = tl.arange(0, KW)
        jv = tl.arange(0, GW)
        t_loc = tl.arange(0, BLOCK)
        t_ok = t_loc < BLOCK  # every slot of a step is stored
        KAH: tl.constexpr = AHEAD % 2 == 1  # the key words a step ahead
        VAH: tl.constexpr = AHEAD // 2 % 2 == 1  # the value tiles' words a step ahead
        PREF: tl.constexpr = AHEAD // 4 if ASM > 0 else 0  # the steps whose codes are asked of the L2 cache ahead
        OWN_KS: tl.constexpr = KPLANES or ROPE  # the key scales read by the logits' own function, not a step ahead
        t_in = tl.maximum(tl.minimum(t_lo, t_hi - BLOCK), 0)
        ks, kz, kw0, kw1, kw2, kw3, zw0, zw1, zw2, zw3, s0, m0, s1, m1, s2, m2, s3, m3, pos_in = _step_loads(
            t_in, ch, jk, t_loc, ks_ptr, kz_ptr, vs_row, vmax_row, pos_ptr, D, KGROUP, VGROUPS, VLOG, VST, HAS_POS, OWN_KS, KPF)
        kwords, u0, u1, u2, u3, w0, w1, w2, w3 = _ahead_words(t_in, kc_ptr, vc_ptr, t_loc, jk, KW, VW, VBITS, KAH, VAH)
        lut = 0
        if ASM and VBITS == 2:
            lut = _level_table(vlev16_ptr)
        q0 = tl.zeros([KW, G], tl.float32)
        q1, q2, q3, q4, q5, q6, q7 = q0, q0, q0, q0, q0, q0, q0
        if KPLANES:  # each code place's query rows, loaded once
            q0, q1, q2, q3, q4, q5, q6, q7 = _plane_queries(q_row, scaling, jk, gi, D)
        if PREF > 1:  # the first steps' codes (the loop asks for step t0 + PREF's)
            _prefetch_step(kc_ptr, vc_ptr, t_in + BLOCK, t_hi, KW, VW, BLOCK, PREF - 1, BULK_PREFETCH)
        for t0 in range(t_lo, t_hi, BLOCK):
            if PREF > 0:
                _prefetch_step(kc_ptr, vc_ptr, t0 + PREF * BLOCK, t_hi, KW, VW, BLOCK, 1, BULK_PREFETCH)
            (ks_n, kz_n, kw0_n, kw1_n, kw2_n, kw3_n, zw0_n, zw1_n, zw2_n, zw3_n, s0_n, m0_n, s1_n, m1_n, s2_n, m2_n, s3_n,
             m3_n, pos_n) = _step_loads(tl.minimum(t0 + BLOCK, t_hi - BLOCK), ch, jk, t_loc, ks_ptr, kz_ptr, vs_row,
                                        vmax_row, pos_ptr, D, KGROUP, VGROUPS, VLOG, VST, HAS_POS, OWN_KS, KPF)
            (kwords_n, u0_n, u1_n, u2_n, u3_n, w0_n, w1_n, w2_n, w3_n) = _ahead_words(
                tl.minimum(t0 + BLOCK, t_hi - BLOCK), kc_ptr, vc_ptr, t_loc, jk, KW, VW, VBITS, KAH, VAH)
            tok = t0 + t_loc
            meta = _over(t0, KGROUP) * D
            if HAS_POS:  # a cache that dropped tokens: each slot's cache index (-1: a filler)
                pos = pos_in
            else:
                pos = first + t0 + t_loc
            if KAH:
                words = kwords
            elif not ROPE:
                words = tl.load(kc_ptr + t0 * KW + t_loc[:, None] * KW + jk[None, :]).to(tl.uint32, bitcast=True)
            if ROPE:
                s = _rope_logits(kc_ptr + t0 * KW, ks_ptr, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_loc, pos, freq_ptr, q_row,
                                 gi, scaling * rope_scale, KW, D, KBITS, KO, LOWP, ASM, ROPE_PAIRS)
            elif KPLANES:  # the step's group's scales folded into the query every step
                qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, bias = _plane_fold(
                    q0, q1, q2, q3, q4, q5, q6, q7, ks_ptr, kz_ptr, meta, kw0, kw1, kw2, kw3, zw0, zw1, zw2, zw3, jk,
                    LOWP, KPF)
                s = _plane_dots(words, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, bias, LOWP, ASM)
            else:
                codes = _words_codes(words, KBITS)  # [BLOCK, D]
                qs = q * ks.to(tl.float32)[:, None]  # [D, G]
                qz = q * kz.to(tl.float32)[:, None]
                if LOWP:  # the operand is 128 + code: 128 times the scaled query's sum taken off, in the same sum
                    qs = qs.to(tl.bfloat16)
                    s = tl.dot(_plus128(codes), qs)
                    bias = tl.sum(qz - 128.0 * qs.to(tl.float32), 0)
                else:
                    s = tl.dot(codes.to(tl.float32), qs, input_precision="ieee")
                    bias = tl.sum(qz, 0)
                s = s + bias[None, :]  # [BLOCK, G]
            if KO > 0 and not ROPE:  # exact outliers: their code is 0, so the key held the zero point
                s = s + tl.trans(_outlier_logits(q_row, kz_ptr, koi_ptr, kov_ptr, meta, tok, t_ok, gi, scaling, D, KO))
            if HIDE:  # slots whose tokens are attended exactly (restored by residuals)
                pos = _hide(pos, t0 + t_loc, hid_ptr + bh * HID, HID)
            visible = pos >= 0
            if HAS_START:
                visible = visible & (pos >= start)
            s = _half(tl.where(visible[:, None], s, float("-inf")), 0, PAD)  # [BLOCK, G // PAD]
            p, alpha, l_i, m_i, top = _softmax_step(s, m_i, l_i, top, (t0 == t_first) & (probe > 0), ASM, FIX)
            vstep = vc_ptr + t0 * VW  # the step's value words (with VTILE: its tile)
            # each channel group's scale folded into the probabilities; with PAD = 2 two groups share a tile
            pa = _probabilities(_pair(p * _scale_of(s0, m0, VLOG, ASM)[:, None], p * _scale_of(s1, m1, VLOG, ASM)[:, None],
                                      PAD), LOWP, ASM, VTILE)
            alpha = tl.reshape(_pair(alpha[None, :], alpha[None, :], PAD), (G,))
            if LEVELS == 3 and FIX:  # levels 1 + code / 16: the weights' sums per slot, for the offset taken off at the end
                w_i = w_i + pa.to(tl.float32)
            elif LEVELS == 3:
                w_i = w_i * alpha[None, :] + pa.to(tl.float32)
            acc0 = _group_step(acc0, pa, alpha, vstep, 0, u0, u1, u2, u3, t_loc, jv, lut, vlev_ptr, vlev16_ptr, l0, l1,
                               VW, GW, VBITS, LEVELS, LOWP, ASM, VTILE, VAH)
            if VGROUPS > 1:
                if PAD == 1:
                    pa = _probabilities(p * _scale_of(s1, m1, VLOG, ASM)[:, None], LOWP, ASM, VTILE)
                acc1 = _group_step(acc1, pa, alpha, vstep, 1, w0, w1, w2, w3, t_loc, jv, lut, vlev_ptr, vlev16_ptr, l0, l1,
                                   VW, GW, VBITS, LEVELS, LOWP, ASM, VTILE, VAH)
            if VGROUPS > 2:
                pb = _probabilities(_pair(p * _scale_of(s2, m2, VLOG, ASM)[:, None],
                                          p * _scale_of(s3, m3, VLOG, ASM)[:, None], PAD), LOWP, ASM, VTILE)
                acc2 = _group_step(acc2, pb, alpha, vstep, 2, 0, 0, 0, 0, t_loc, jv, lut, vlev_ptr, vlev16_ptr, l0, l1,
                                   VW, GW, VBITS, LEVELS, LOWP, ASM, VTILE, False)
                if PAD == 1:
                    pb = _probabilities(p * _scale_of(s3, m3, VLOG, ASM)[:, None], LOWP, ASM, VTILE)
                acc3 = _group_step(acc3, pb, alpha, vstep, 3, 0, 0, 0, 0, t_loc, jv, lut, vlev_ptr, vlev16_ptr, l0, l1,
                                   VW, GW, VBITS, LEVELS, LOWP, ASM, VTILE, False)
            ks, kz, kw0, kw1, kw2, kw3, zw0, zw1, zw2, zw3 = ks_n, kz_n, kw0_n, kw1_n, kw2_n, kw3_n, zw0_n, zw1_n, zw2_n, zw3_n
            kwords, u0, u1, u2, u3, w0, w1, w2, w3 = kwords_n, u0_n, u1_n, u2_n, u3_n, w0_n, w1_n, w2_n, w3_n
            s0, m0, s1, m1, s2, m2, s3, m3, pos_in = s0_n, m0_n, s1_n, m1_n, s2_n, m2_n, s3_n, m3_n, pos_n
        return m_i, l_i, w_i, acc0, acc1, acc2, acc3, top

    @triton.jit
    def _ranges(lo, hi, m_i, BLOCK: tl.constexpr, R: tl.constexpr, G: tl.constexpr, VGROUP: tl.constexpr, q, q_row, bh,
                start, first, scaling, l0, l1, tokens, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row,
                vmax_row, vlev_ptr, vlev16_ptr, pos_ptr, hid_ptr, freq_ptr, rope_scale, probe, D: tl.constexpr,
                KBITS: tl.constexpr,
                KGROUP: tl.constexpr, KO: tl.constexpr, VBITS: tl.constexpr, HAS_START: tl.constexpr, LOWP: tl.constexpr,
                LEVELS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr, HAS_POS: tl.constexpr, HID: tl.constexpr,
                ASM: tl.constexpr, KPLANES: tl.constexpr, KPF: tl.constexpr, AHEAD: tl.constexpr, VTILE: tl.constexpr,
                PAD: tl.constexpr, QG: tl.constexpr, FIX: tl.constexpr, ROPE: tl.constexpr,
                ROPE_PAIRS: tl.constexpr):
        """A program's steps ``lo .. hi`` from a fresh start (``m_i``: the reference with ``FIX``, else -inf): its
        maximum or reference, sums, outputs and each slot's largest logit."""
        l_i = tl.zeros([BLOCK, R], tl.float32)  # each slot's running sum of probabilities (:func:`_steps`)
        w_i = tl.zeros([BLOCK, G], tl.float32)  # LEVELS = 3: each slot's running sum of the value products' weights
        acc0 = tl.zeros([VGROUP, G], tl.float32)  # one accumulator per value channel group (at most 4)
        acc1, acc2, acc3 = acc0, acc0, acc0
        top = tl.full([BLOCK, R], float("-inf"), tl.float32)
        if HID > 0:  # only the steps from the first to the last hidden slot check the list; the others run the code of a
            # storage that hides none (checked in every step, the list took 15-19% of the kernel at B = 128, 64K)
            listed = tl.load(hid_ptr + bh * HID + tl.arange(0, HID))  # -1: none
            t_a = tl.maximum(lo, tl.minimum(hi, tl.min(tl.where(listed >= 0, listed, tokens), 0) // BLOCK * BLOCK))
            t_b = tl.maximum(t_a, tl.minimum(hi, (tl.max(listed, 0) // BLOCK + 1) * BLOCK))
            m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _steps(
                lo, t_a, m_i, l_i, w_i, acc0, acc1, acc2, acc3, q, q_row, bh, start, first, scaling, l0, l1,
                kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr,
                hid_ptr, freq_ptr, rope_scale, D, G, KBITS, KGROUP, KO, VBITS, VGROUP, HAS_START, BLOCK, LOWP, LEVELS, VLOG,
                VST, HAS_POS, HID, False, ASM, KPLANES, KPF, AHEAD, VTILE, PAD, QG, top, probe, lo, FIX, ROPE,
                ROPE_PAIRS)
            m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _steps(
                t_a, t_b, m_i, l_i, w_i, acc0, acc1, acc2, acc3, q, q_row, bh, start, first, scaling, l0, l1,
                kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr,
                hid_ptr, freq_ptr, rope_scale, D, G, KBITS, KGROUP, KO, VBITS, VGROUP, HAS_START, BLOCK, LOWP, LEVELS, VLOG,
                VST, HAS_POS, HID, True, ASM, KPLANES, KPF, AHEAD, VTILE, PAD, QG, top, probe, lo, FIX, ROPE,
                ROPE_PAIRS)
            m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _steps(
                t_b, hi, m_i, l_i, w_i, acc0, acc1, acc2, acc3, q, q_row, bh, start, first, scaling, l0, l1,
                kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr,
                hid_ptr, freq_ptr, rope_scale, D, G, KBITS, KGROUP, KO, VBITS, VGROUP, HAS_START, BLOCK, LOWP, LEVELS, VLOG,
                VST, HAS_POS, HID, False, ASM, KPLANES, KPF, AHEAD, VTILE, PAD, QG, top, probe, lo, FIX, ROPE,
                ROPE_PAIRS)
        else:
            m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _steps(
                lo, hi, m_i, l_i, w_i, acc0, acc1, acc2, acc3, q, q_row, bh, start, first, scaling, l0, l1,
                kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr,
                hid_ptr, freq_ptr, rope_scale, D, G, KBITS, KGROUP, KO, VBITS, VGROUP, HAS_START, BLOCK, LOWP, LEVELS, VLOG,
                VST, HAS_POS, HID, False, ASM, KPLANES, KPF, AHEAD, VTILE, PAD, QG, top, probe, lo, FIX, ROPE,
                ROPE_PAIRS)
        return m_i, l_i, w_i, acc0, acc1, acc2, acc3, top

    @triton.jit
    def _lowbit_dense_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_ptr, vmax_ptr, vlev_ptr, vlev16_ptr, start_ptr,
        pos_ptr, hid_ptr, freq_ptr, m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, long_splits, short_len, first, scaling, l0, l1, rope_scale, trace_ptr,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr, LOWP: tl.constexpr,
        LEVELS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr, HAS_POS: tl.constexpr, HID: tl.constexpr,
        ASM: tl.constexpr, KPLANES: tl.constexpr, KPF: tl.constexpr, AHEAD: tl.constexpr, VTILE: tl.constexpr,
        PAD: tl.constexpr, QG: tl.constexpr, FIX: tl.constexpr, FIX_LIMIT: tl.constexpr, PDL: tl.constexpr,
        ROPE: tl.constexpr, ROPE_PAIRS: tl.constexpr, TRACE: tl.constexpr = 0,
    ):
        """One program per (batch row x KV head, split of the packed tokens); the split is whole steps of ``BLOCK``
        tokens (``BLOCK`` divides ``KGROUP``), so nothing is masked but slots that are fillers, before the row's first
        visible position, or hidden. Tiles are token-major (logits [BLOCK, G], outputs [channels, G]): the unpacked codes
        are the products' first operand (rows: tokens, channels), the query heads (8 rows at least) the second, read where
        the model left them (``q_ptr`` [B, KV heads x ``QG``, D], any float dtype; a padding row repeats a real one).
        Writes the split's maximum (with ``FIX``: its reference), sum and output in the rotated space, for the combine;
        the steps take each field from the row's first token (the pointers are moved there first). ``KPLANES``: 4-bit keys
        read by code places (:func:`_plane_fold`, :func:`_plane_dots`); ``KPF``: their scales and zero points loaded a step ahead as int32
        words; ``PAD`` = 2: the ``G / 2`` real query rows each fill two columns (:func:`_steps`), only they written.
        Splits ``long_splits ..`` of a row are ``short_len`` tokens, the others ``split_len``.
        ``PDL``: the combine may be launched once every program has begun (it waits for this kernel's end before it
        reads the splits). ``TRACE``: each program's start, end and SM written to ``trace_ptr``
        (:mod:`kvweave.kernels.timeline`; a placeholder otherwise)."""
        if TRACE:
            begin_ns, begin_cycles = _begin_stamp()
        if PDL:
            gdc_launch_dependents()
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        scaling = scaling * 1.4426950408889634  # log2(e): the logits in base 2, each exponential one ex2 (m stored in base e)
        VGROUPS: tl.constexpr = D // VGROUP
        R: tl.constexpr = G // PAD  # the rows written: the real query rows with PAD = 2
        gi = tl.minimum(tl.arange(0, G) // PAD, QG - 1)
        ri, ch, cg = tl.arange(0, R), tl.arange(0, D), tl.arange(0, VGROUP)
        row = bh.to(tl.int64) * tokens
        q_row = q_ptr + bh.to(tl.int64) * QG * D  # the query heads [B, KV heads x QG, D] as the model made them
        q = tl.load(q_row + gi[None, :] * D + ch[:, None]).to(tl.float32) * scaling  # [D, G]
        KW: tl.constexpr = D * KBITS // 32
        VW: tl.constexpr = D * VBITS // 32
        kc_ptr += row * KW  # each field from the row's first token: the steps' offsets in 32 bits
        ks_ptr += row // KGROUP * D
        kz_ptr += row // KGROUP * D
        koi_ptr += row * KO
        kov_ptr += row * KO
        vc_ptr += row * VW
        pos_ptr += row
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        short = split >= long_splits  # the last splits of a row may be shorter (kvweave.kernels.lowbit_tail.dense_tail)
        lo = tl.where(short, long_splits * split_len + (split - long_splits) * short_len, split * split_len)
        hi = tl.minimum(lo + tl.where(short, short_len, split_len), tokens)
        m_i = tl.full([R], float("-inf"), tl.float32)  # with FIX, the pass loop's carried values start here
        l_i, w_i = tl.zeros([BLOCK, R], tl.float32), tl.zeros([BLOCK, G], tl.float32)
        acc0 = tl.zeros([VGROUP, G], tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        vs_row = vs_ptr + row * VGROUPS  # value scales indexed from the row's first token (log8 maxima by t // VST)
        vmax_row = vmax_ptr + row // VST * VGROUPS
        top = tl.full([BLOCK, R], float("-inf"), tl.float32)
        if FIX:  # a first pass against the first step's largest logit, a second against the largest seen if it rose by
            # more than FIX_LIMIT (base 2): no maximum across the warps and no rescaling in the steps
            again, probe, phi = 1, 1, m_i
            for attempt in range(2):
                if again > 0:
                    m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _ranges(
                        lo, hi, phi, BLOCK, R, G, VGROUP, q, q_row, bh, start, first, scaling, l0, l1, tokens,
                        kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr,
                        hid_ptr, freq_ptr, rope_scale, probe, D, KBITS, KGROUP, KO, VBITS, HAS_START, LOWP, LEVELS, VLOG,
                        VST, HAS_POS, HID, ASM, KPLANES, KPF, AHEAD, VTILE, PAD, QG, True, ROPE, ROPE_PAIRS)
                    seen = tl.max(top, 0)
                    again = probe * tl.max((~(seen - m_i <= FIX_LIMIT)).to(tl.int32), 0)
                    probe, phi = 0, seen
        else:
            m_i, l_i, w_i, acc0, acc1, acc2, acc3, top = _ranges(
                lo, hi, m_i, BLOCK, R, G, VGROUP, q, q_row, bh, start, first, scaling, l0, l1, tokens, kc_ptr, kz_ptr,
                ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_row, vmax_row, vlev_ptr, vlev16_ptr, pos_ptr, hid_ptr, freq_ptr,
                rope_scale, 0, D, KBITS, KGROUP, KO, VBITS, HAS_START, LOWP, LEVELS, VLOG, VST, HAS_POS, HID, ASM, KPLANES,
                KPF, AHEAD, VTILE, PAD, QG, False, ROPE, ROPE_PAIRS)
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + ri, m_i * 0.6931471805599453)
        tl.store(l_ptr + out + ri, tl.sum(l_i, 0))
        weight = 16.0 if VBITS == 4 and LEVELS % 2 == 1 else 1.0  # _uniform4_tiles' levels are over 16
        if LEVELS == 3:  # levels 1 + code / 16, not (code - 7.5) / 16: 1.46875 times the weights' sums taken off
            offset = 1.46875 * tl.sum(w_i, 0)[None, :]  # one sum of the slots for both groups' columns
            acc0, acc1 = acc0 - offset, acc1 - offset
        base = acc_ptr + out.to(tl.int64) * D + ri[None, :] * D + _value_channels(cg, VBITS, LEVELS, VTILE)[:, None]
        tl.store(base, _half(acc0, 0, PAD) * weight)  # [VGROUP, R]: the outputs transposed
        if VGROUPS > 1:
            tl.store(base + VGROUP, _half(acc1, 1, PAD) * weight)
        if VGROUPS > 2:
            tl.store(base + 2 * VGROUP, _half(acc2, 0, PAD) * weight)
            tl.store(base + 3 * VGROUP, _half(acc3, 1, PAD) * weight)
        if TRACE:
            _end_stamp(trace_ptr, bh * splits + split, begin_ns, begin_cycles, begin_cycles)
