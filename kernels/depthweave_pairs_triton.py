"""The ``pairs`` form of DepthWeave-KV's ``tiles`` packed-token pass (launched by
:mod:`kvweave.kernels.depthweave_decode` where a KV head has four query heads and ``TILES_PAIRS`` is on): the same
partial (max, sum, output) slots over the same bytes, without the tile's padding columns.

The ``tiles`` pass (:mod:`kvweave.kernels.depthweave_tiles_triton`) holds a step's tokens as its tiles' rows and the
query heads as columns, at least 8 of them, the smallest width of a tensor-core product. Four query heads fill half of
those columns, so half of its softmax, its per-slot sums and its output products work on a repeated head. Here a tile
row holds two neighbouring tokens, ``2 i`` and ``2 i + 1``, and the 8 columns are the four heads twice: column ``c``
scores head ``c % 4`` against token ``2 i + c // 4``. The key product is the same size as the ``tiles`` pass's: a row's
codes are the two tokens' side by side ([BLOCK / 2, 2 RC]), against the query in coefficient space placed twice on the
block diagonal ([2 RC, 8], zeros elsewhere). The residual coordinates of the two tokens fill the 16 columns of a
rank-8 level's tile that the ``tiles`` pass pads with zeros.

So each column keeps a softmax of its own over half of the tokens: two partials a head, merged by their maxima once
after the loop (and their value sums projected to head_dim through the basis rows stacked twice, each half keeping
only its own tokens' block). The rows of the value products that mix one token's codes with the other's
probabilities are computed and dropped, as the ``tiles`` pass computes its padding columns.

Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.decode_triton import _program, _rows
    from kvweave.kernels.depthweave_tiles_triton import _as_word, _coefficients, _popc, _word_ptr
    from kvweave.kernels.grid_dependency_triton import gdc_wait

    @triton.jit
    def _pair_level_rows(base_ptr, stride_r, RMAX: tl.constexpr, RQ: tl.constexpr, D: tl.constexpr):
        """The residual basis's rows where :func:`_pair_tile` puts their coordinates, [RQ, D] float16: column ``c``
        (token ``c // (RQ / 2)`` of a row) holds row ``k`` where ``c % (RQ / 2) = k * step``, zeros between."""
        c = tl.arange(0, RQ)
        NPT: tl.constexpr = RQ // 2
        step: tl.constexpr = NPT // RMAX
        d = tl.arange(0, D)
        rows = tl.load(base_ptr + ((c % NPT) // step)[:, None] * stride_r + d[None, :],
                       mask=(((c % NPT) % step) == 0)[:, None], other=0.0)
        return rows.to(tl.float32).to(tl.float16)

    @triton.jit
    def _pair_tile(cwa, swa, cwb, swb, RMAX: tl.constexpr, RQ: tl.constexpr, GROUP: tl.constexpr):
        """The residual coordinates of a step's token pairs as [BLOCK / 2, RQ] float16: the even token's (code word
        ``cwa``, scale word ``swa``, [BLOCK / 2, 1]) in the first ``RQ / 2`` columns, the odd token's after them, each
        coordinate ``k`` at column ``k * step`` of its half (``step = RQ / 2 / RMAX``), as the ``tiles`` pass's
        ``_residual_tile`` makes one token's: nibble ``k`` less 8, times half ``k // GROUP`` of the scale word."""
        c = tl.arange(0, RQ)
        NPT: tl.constexpr = RQ // 2
        step: tl.constexpr = NPT // RMAX
        k = (c % NPT) // step
        even = (c < NPT)[None, :]
        cw = tl.where(even, cwa, cwb)
        sw = tl.where(even, swa, swb)
        nib = (cw >> (4 * k).to(cw.dtype)[None, :]) & 15
        half = (sw >> (16 * (k // GROUP)).to(sw.dtype)[None, :]) & 0xFFFF
        code = (nib.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        value = code * half.to(tl.uint16).to(tl.float16, bitcast=True)
        return tl.where((((c % NPT) % step) == 0)[None, :], value, 0.0).to(tl.float16)

    @triton.jit
    def _pair_scales(s_ptr, t0, hi, i, s_st, side):
        """Each score's token scale (one a token), float32 [BLOCK / 2, G]: the even token's in the columns of
        ``side`` 0, the odd one's in the others, each loaded once as a vector."""
        tok = (t0 + 2 * i)[:, None] + tl.arange(0, 2)[None, :]
        even, odd = tl.split(tl.load(s_ptr + tok * s_st, mask=tok < hi, other=0.0).to(tl.float32))
        return tl.where((side == 0)[None, :], even[:, None], odd[:, None])

    @triton.jit
    def _pair_level_words(pk_ptr, sc_ptr, ts_ptr, tm_ptr, row, t0, hi, ta, cwa, swa, cwb, swb, RANK: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK: tl.constexpr, CW64: tl.constexpr, SW64: tl.constexpr,
                          ASM: tl.constexpr):
        """One level's code and scale words put in at the step's even tokens ``t0 + ta`` ([BLOCK / 2, 1]) and the odd
        ones after them, where they have an entry there (as the ``tiles`` pass's ``_level_words``). A pair lies in one
        32-token tile of the index, so its start and mask are read once; the odd token's entry follows the even
        one's, or is the even one's place where that token has none."""
        if RANK > 0:
            tile = row + t0 // 32
            live = t0 < hi  # a step read ahead may lie past the segment (and past the index's last row)
            first = tl.load(ts_ptr + tile, mask=live, other=0)
            mask = tl.load(tm_ptr + tile, mask=live, other=0).to(tl.uint32, bitcast=True)
            if BLOCK == 64:  # the second tile, where the segment holds it
                ahead = t0 + 32 < hi
                first = tl.where(ta < 32, first, tl.load(ts_ptr + tile + 1, mask=ahead, other=0))
                mask = tl.where(ta < 32, mask, tl.load(tm_ptr + tile + 1, mask=ahead, other=0).to(tl.uint32, bitcast=True))
            bit = (ta % 32).to(tl.uint32)
            has_a = (mask >> bit) & 1
            has_b = (mask >> (bit + 1)) & 1
            present_a = (t0 + ta < hi) & (has_a != 0)
            present_b = (t0 + ta + 1 < hi) & (has_b != 0)
            entry = first + _popc(mask & ((tl.full(bit.shape, 1, tl.uint32) << bit) - 1), ASM)
            codes_ptr = _word_ptr(pk_ptr, RANK * 4)
            scales_ptr = _word_ptr(sc_ptr, 16 * (RANK // GROUP))
            cwa = tl.where(present_a, _as_word(tl.load(codes_ptr + entry, mask=present_a, other=0), CW64), cwa)
            swa = tl.where(present_a, _as_word(tl.load(scales_ptr + entry, mask=present_a, other=0), SW64), swa)
            entry += has_a.to(tl.int32)
            cwb = tl.where(present_b, _as_word(tl.load(codes_ptr + entry, mask=present_b, other=0), CW64), cwb)
            swb = tl.where(present_b, _as_word(tl.load(scales_ptr + entry, mask=present_b, other=0), SW64), swb)
        return cwa, swa, cwb, swb

    @triton.jit
    def _pair_words(p0, s0, i0, m0, p1, s1, i1, m1, p2, s2, i2, m2, row, t0, hi, ta, RANK0: tl.constexpr,
                    RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                    CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """The residual code and scale words of a step's even tokens (``ta``: [BLOCK / 2, 1] offsets) and odd ones,
        over the levels (zeros without an entry)."""
        cwa = _as_word(tl.zeros(ta.shape, tl.uint32), CW64)
        swa = _as_word(tl.zeros(ta.shape, tl.uint32), SW64)
        cwb, swb = cwa, swa
        cwa, swa, cwb, swb = _pair_level_words(p0, s0, i0, m0, row, t0, hi, ta, cwa, swa, cwb, swb, RANK0, GROUP,
                                               BLOCK, CW64, SW64, ASM)
        cwa, swa, cwb, swb = _pair_level_words(p1, s1, i1, m1, row, t0, hi, ta, cwa, swa, cwb, swb, RANK1, GROUP,
                                               BLOCK, CW64, SW64, ASM)
        cwa, swa, cwb, swb = _pair_level_words(p2, s2, i2, m2, row, t0, hi, ta, cwa, swa, cwb, swb, RANK2, GROUP,
                                               BLOCK, CW64, SW64, ASM)
        return cwa, swa, cwb, swb

    @triton.jit
    def _pairs_kernel(
        q_ptr, seg_ptr, start_ptr,
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, c_sb, c_sh, c_st, s_sb, s_sh, s_st,
        kb_ptr, vb_ptr, b_sb, b_sh, b_sv, b_sr,
        krb_ptr, vrb_ptr, rb_sb, rb_sh, rb_sr, kg_ptr, vg_ptr,
        k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm,
        m_ptr, l_ptr, acc_ptr, partials, H, tiles, qk_scale,
        GQ: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr, RQ: tl.constexpr,
        RMAX: tl.constexpr, RANK0: tl.constexpr, RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr,
        K_GATES: tl.constexpr, V_GATES: tl.constexpr, BLOCK: tl.constexpr, ASM: tl.constexpr, AHEAD: tl.constexpr,
        VALUES: tl.constexpr = True, PDL: tl.constexpr = False, BYTES: tl.constexpr = False,
    ):
        """One program per (segment, batch row x KV head), with the ``tiles`` pass's arguments in the same order;
        ``GQ`` (4) query heads, ``RQ`` the residual tile's columns (two tokens' ``RMAX`` coordinates, at least 16).
        Its residual words are read as the ``tiles`` pass reads them with ``COLUMNS``, a step ahead with ``AHEAD``;
        its value codes token-major (``ROWS``); ``BYTES``, ``VALUES`` and ``PDL`` as there."""
        seg, bh, b, h, lo, hi, version, first_valid, k_gate, v_gate = _program(seg_ptr, start_ptr, kg_ptr, vg_ptr, H,
                                                                               K_GATES, V_GATES)
        ONE_SCALE: tl.constexpr = RB >= R
        CW64: tl.constexpr = RMAX > 8
        SW64: tl.constexpr = RMAX // GROUP > 2
        G: tl.constexpr = 2 * GQ
        NR: tl.constexpr = BLOCK // 2
        NPT: tl.constexpr = RQ // 2
        col = tl.arange(0, G)
        side = col // GQ  # the token of a row each column scores: 0 even, 1 odd
        c2 = tl.arange(0, 2 * RC)
        cr = c2 % RC  # a code column's coefficient; c2 // RC its token
        cq = tl.arange(0, RQ)
        d = tl.arange(0, D)
        i = tl.arange(0, NR)
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + (bh * GQ + col % GQ)[None, :] * D + d[:, None]).to(tl.float32) * qk_scale  # [D, G]
        q16 = q.to(tl.float16)
        kb = kb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        # the query in coefficient space on the block diagonal: rows of token s against the columns scoring token s
        qp = tl.dot(_rows(kb, b_sr, R, RC, D).to(tl.float16), q16).to(tl.float16)  # [RC, G]
        qp = tl.reshape(tl.permute(tl.join(tl.where((side == 0)[None, :], qp, 0.0), tl.where((side == 1)[None, :], qp, 0.0)),
                                   (2, 0, 1)), (2 * RC, G))
        qr = tl.zeros((RQ, G), dtype=tl.float16)
        if RMAX > 0:
            kres = _pair_level_rows(krb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, RQ, D)
            qr = tl.where((cq // NPT)[:, None] == side[None, :], tl.dot(kres, q16) * k_gate, 0.0).to(tl.float16)

        kc = kc_ptr + b64 * c_sb + h * c_sh
        vc = vc_ptr + b64 * c_sb + h * c_sh
        ks = ks_ptr + b64 * s_sb + h * s_sh
        vs = vs_ptr + b64 * s_sb + h * s_sh
        row = bh * tiles
        m_i = tl.full((G,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((NR, G), dtype=tl.float32)
        acc_c = tl.zeros((2 * RC, G), dtype=tl.float32)
        acc_r = tl.zeros((RQ, G), dtype=tl.float32)
        ta = (2 * i)[:, None]  # a row's even token, as a column [NR, 1]
        kca = _as_word(tl.zeros(ta.shape, tl.uint32), CW64)
        ksa = _as_word(tl.zeros(ta.shape, tl.uint32), SW64)
        kcb, ksb, vca, vsa, vcb, vsb = kca, ksa, kca, ksa, kca, ksa
        if AHEAD and RMAX > 0:
            kca, ksa, kcb, ksb = _pair_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc,
                                             k2_ts, k2_tm, row, lo, hi, ta, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64,
                                             SW64, ASM)
            if VALUES:
                vca, vsa, vcb, vsb = _pair_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc,
                                                 v2_ts, v2_tm, row, lo, hi, ta, RANK0, RANK1, RANK2, GROUP, BLOCK,
                                                 CW64, SW64, ASM)
        for t0 in range(lo, hi, BLOCK):
            has = (t0 + ta + (c2 // RC)[None, :] < hi) & (cr < R)[None, :]  # [NR, 2 RC]: a code of a token there
            at = (t0 + ta) * c_st + ((c2 // RC) * c_st + cr)[None, :]  # each code's offset: its row's, then its own
            tok_s = t0 + ta + side[None, :]  # [NR, G]: the token each score is of
            ok = (tok_s < hi) & (tok_s >= first_valid)
            k_ca, k_sa, k_cb, k_sb, v_ca, v_sa, v_cb, v_sb = kca, ksa, kcb, ksb, vca, vsa, vcb, vsb
            if AHEAD and RMAX > 0:  # the next step's words, issued before this step's products
                after = t0 + BLOCK
                kca, ksa, kcb, ksb = _pair_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc,
                                                 k2_ts, k2_tm, row, after, hi, ta, RANK0, RANK1, RANK2, GROUP, BLOCK,
                                                 CW64, SW64, ASM)
                if VALUES:
                    vca, vsa, vcb, vsb = _pair_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk,
                                                     v2_sc, v2_ts, v2_tm, row, after, hi, ta, RANK0, RANK1, RANK2,
                                                     GROUP, BLOCK, CW64, SW64, ASM)
            ck = tl.load(kc + at, mask=has, other=0)
            if ONE_SCALE:
                s = tl.dot(_coefficients(ck, BYTES), qp) * _pair_scales(ks, t0, hi, i, s_st, side)  # [NR, G]
            else:
                kbs = tl.load(ks + (t0 + ta) * s_st + ((c2 // RC) * s_st + cr // RB)[None, :], mask=has, other=0.0)
                s = tl.dot(_coefficients(ck, BYTES) * kbs.to(tl.float16), qp)
            if RMAX > 0:
                if not AHEAD:
                    k_ca, k_sa, k_cb, k_sb = _pair_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk,
                                                         k2_sc, k2_ts, k2_tm, row, t0, hi, ta, RANK0, RANK1, RANK2,
                                                         GROUP, BLOCK, CW64, SW64, ASM)
                s = tl.dot(_pair_tile(k_ca, k_sa, k_cb, k_sb, RMAX, RQ, GROUP), qr, s)
            s = tl.where(ok, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok, tl.exp2(s - m_new[None, :]), 0.0)  # [NR, G]
            l_i = l_i * alpha[None, :] + p
            m_i = m_new
            if VALUES:  # rows of token s times the columns of token s are the sums kept; the others are dropped
                cv = _coefficients(tl.load(vc + at, mask=has, other=0), BYTES)
                if ONE_SCALE:
                    acc_c = tl.dot(tl.trans(cv), (p * _pair_scales(vs, t0, hi, i, s_st, side)).to(tl.float16),
                                   acc_c * alpha[None, :])
                else:
                    vbs = tl.load(vs + (t0 + ta) * s_st + ((c2 // RC) * s_st + cr // RB)[None, :], mask=has, other=0.0)
                    acc_c = tl.dot(tl.trans(cv * vbs.to(tl.float16)), p.to(tl.float16), acc_c * alpha[None, :])
                if RMAX > 0:
                    if not AHEAD:
                        v_ca, v_sa, v_cb, v_sb = _pair_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm,
                                                             v2_pk, v2_sc, v2_ts, v2_tm, row, t0, hi, ta, RANK0, RANK1,
                                                             RANK2, GROUP, BLOCK, CW64, SW64, ASM)
                    e = _pair_tile(v_ca, v_sa, v_cb, v_sb, RMAX, RQ, GROUP)
                    acc_r = tl.dot(tl.trans(e), p.to(tl.float16), acc_r * alpha[None, :])

        # a head's two columns merged: their common maximum, each column's weight under it
        m_head = tl.max(tl.reshape(m_i, (2, GQ)), axis=0)  # [GQ]
        w = tl.exp2(m_i - tl.reshape(tl.broadcast_to(m_head[None, :], (2, GQ)), (G,)))  # [G]
        heads = tl.arange(0, GQ)
        slot = (bh * GQ + heads) * partials + seg
        tl.store(m_ptr + slot, m_head)
        tl.store(l_ptr + slot, tl.sum(tl.reshape(tl.sum(l_i, axis=0) * w, (2, GQ)), axis=0))
        if VALUES:
            # back to head_dim through the basis rows stacked twice, each column keeping its own token's rows
            vb = vb_ptr + b64 * b_sb + h * b_sh + version * b_sv
            # each column's own token's rows [RC, G]: rows s RC + r of the columns scoring token s
            own = tl.sum(tl.where((tl.arange(0, 2) == 0)[:, None, None] == (side == 0)[None, None, :],
                                  tl.reshape(acc_c * w[None, :], (2, RC, G)), 0.0), axis=0)
            out = tl.dot(tl.trans(_rows(vb, b_sr, R, RC, D).to(tl.float16)), own.to(tl.float16))  # [D, G]
            if RMAX > 0:
                vres = _pair_level_rows(vrb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, RQ, D)
                own_r = tl.where((cq // NPT)[:, None] == side[None, :], acc_r * (w * v_gate)[None, :], 0.0)
                out = tl.dot(tl.trans(vres), own_r.to(tl.float16), out)
            tl.store(acc_ptr + slot[None, :] * D + d[:, None], tl.sum(tl.reshape(out, (D, 2, GQ)), axis=1))
        if PDL:  # as the tiles pass: done only once the exact-window pass is
            gdc_wait()
