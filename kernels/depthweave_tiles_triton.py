"""The ``tiles`` packed-token pass of DepthWeave-KV's fused decode (launched by
:mod:`kvweave.kernels.depthweave_decode`): the same sums as :func:`kvweave.kernels.decode_triton._packed_split_kernel`
over the same bytes, computed token-major.

A step holds ``BLOCK`` tokens (32 or 64: one or two tiles of the residual index) as the rows of its tiles and the query
heads of one KV head as columns (``G``: at least 8, a padding column repeats the last real head and is never written).
The int8 coefficients are the first operand of the key product as loaded; the value coefficients the first operand of
the output product, loaded transposed. A token's residual entry, at whichever rank level holds it, is read as two words:
its codes (``rank / 2`` bytes, one load) and its scales (``rank / group`` float16 numbers, one load), found through the
level's tile index (read as scalars, one or two words a step) by one population count. The levels' words are merged
per token (a token has at most one entry a kind), so one residual tile a kind is built per step, each coordinate's
nibble and scale cut from the words in registers: no per-coordinate gather. One warp a program was the fastest on the
H200 (docs/kernels.md, "DepthWeave-KV's packed tokens read token-major"). Without triton the module defines nothing
(``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.grid_dependency_triton import gdc_wait
    from kvweave.kernels.decode_triton import _level_rows, _program, _rows
    from kvweave.kernels.depthweave_operands_triton import (_as_word, _coefficients, _popc, _residual_tile,
                                                            _word_coefficients, _word_ptr)
    from kvweave.kernels.prefetch_triton import BULK_PREFETCH, _prefetch_bytes
    from kvweave.kernels.timeline_triton import _begin_stamp, _end_stamp

    @triton.jit
    def _prefetch_coefficients(kc, vc, ks, vs, t0, hi, c_st, s_st, BLOCK: tl.constexpr, RC: tl.constexpr,
                               VALUES: tl.constexpr):
        """Step ``t0``'s coefficient codes and scales (keys', and values' with ``VALUES``) asked of the L2 cache; nothing
        past the segment's end ``hi``."""
        rows = tl.minimum(hi - t0, BLOCK)
        if rows > 0:
            _prefetch_bytes(kc + t0 * c_st, rows * c_st, BLOCK * RC // 128, BULK_PREFETCH)
            _prefetch_bytes(ks + t0 * s_st, rows * s_st * 2, (BLOCK * 2 + 127) // 128, BULK_PREFETCH)
            if VALUES:
                _prefetch_bytes(vc + t0 * c_st, rows * c_st, BLOCK * RC // 128, BULK_PREFETCH)
                _prefetch_bytes(vs + t0 * s_st, rows * s_st * 2, (BLOCK * 2 + 127) // 128, BULK_PREFETCH)

    @triton.jit
    def _level_index(ts_ptr, tm_ptr, row, t0, hi, RANK: tl.constexpr, BLOCK: tl.constexpr):
        """One level's tile index at the step ``t0``: for the step's first 32-token tile and its second (``BLOCK`` 64;
        else the first again), the tile's first entry and bit mask as one int64 scalar (``first << 32 | mask``); zeros
        without the level or past the segment. ``row``: the level's tile-index row."""
        one = tl.zeros((), tl.int64)
        two = one
        if RANK > 0:
            tile = row + t0 // 32
            live = t0 < hi  # a step read ahead may lie past the segment (and past the index's last row)
            one = (tl.load(ts_ptr + tile, mask=live, other=0).to(tl.int64) << 32) | \
                tl.load(tm_ptr + tile, mask=live, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
            two = one
            if BLOCK == 64:  # the second tile, where the segment holds it
                ahead = t0 + 32 < hi
                two = (tl.load(ts_ptr + tile + 1, mask=ahead, other=0).to(tl.int64) << 32) | \
                    tl.load(tm_ptr + tile + 1, mask=ahead, other=0).to(tl.uint32, bitcast=True).to(tl.int64)
        return one, two

    @triton.jit
    def _level_entries(pk_ptr, sc_ptr, one, two, t, inside, cw, sw, RANK: tl.constexpr, GROUP: tl.constexpr,
                       CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """``cw``, ``sw`` [BLOCK] with one level's code word and scale word put in at the tokens ``t`` that have an entry
        there, found through the level's tile index ``one``, ``two`` (:func:`_level_index`): the entry of token
        ``32 j + i`` is ``first[j] + popcount(mask[j] & (2^i - 1))``."""
        if RANK > 0:
            index = tl.where(t < 32, one, two)
            first = (index >> 32).to(tl.int32)
            mask = index.to(tl.uint32)
            bit = (t % 32).to(tl.uint32)
            present = inside & (((mask >> bit) & 1) != 0)
            below = mask & ((tl.full(bit.shape, 1, tl.uint32) << bit) - 1)
            entry = first + _popc(below, ASM)  # loaded only where present: a level without entries may point nowhere
            codes = tl.load(_word_ptr(pk_ptr, RANK * 4) + entry, mask=present, other=0)
            scales = tl.load(_word_ptr(sc_ptr, 16 * (RANK // GROUP)) + entry, mask=present, other=0)
            cw = tl.where(present, _as_word(codes, CW64), cw)
            sw = tl.where(present, _as_word(scales, SW64), sw)
        return cw, sw

    @triton.jit
    def _merged_index(i0, m0, i1, m1, i2, m2, row, t0, hi, RANK0: tl.constexpr, RANK1: tl.constexpr,
                      RANK2: tl.constexpr, BLOCK: tl.constexpr):
        """The three levels' tile index at the step ``t0`` (:func:`_level_index`), for :func:`_merged_entries`."""
        f0, b0 = _level_index(i0, m0, row, t0, hi, RANK0, BLOCK)
        f1, b1 = _level_index(i1, m1, row, t0, hi, RANK1, BLOCK)
        f2, b2 = _level_index(i2, m2, row, t0, hi, RANK2, BLOCK)
        return f0, b0, f1, b1, f2, b2

    @triton.jit
    def _merged_entries(p0, s0, p1, s1, p2, s2, f0, b0, f1, b1, f2, b2, t, inside, RANK0: tl.constexpr,
                        RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr, CW64: tl.constexpr,
                        SW64: tl.constexpr, ASM: tl.constexpr):
        """Each token's residual code word and scale word over the levels from their tile index read before."""
        cw = _as_word(tl.zeros(t.shape, tl.uint32), CW64)
        sw = _as_word(tl.zeros(t.shape, tl.uint32), SW64)
        cw, sw = _level_entries(p0, s0, f0, b0, t, inside, cw, sw, RANK0, GROUP, CW64, SW64, ASM)
        cw, sw = _level_entries(p1, s1, f1, b1, t, inside, cw, sw, RANK1, GROUP, CW64, SW64, ASM)
        cw, sw = _level_entries(p2, s2, f2, b2, t, inside, cw, sw, RANK2, GROUP, CW64, SW64, ASM)
        return cw, sw

    @triton.jit
    def _entries_ahead(p0, s0, i0, m0, p1, s1, i1, m1, p2, s2, i2, m2, f0, b0, f1, b1, f2, b2, row, t0, hi, t,
                       RANK0: tl.constexpr, RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK: tl.constexpr, CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """The step ``t0``'s residual words by its tile index read before (``f0 .. b2``), and the next step's index."""
        cw, sw = _merged_entries(p0, s0, p1, s1, p2, s2, f0, b0, f1, b1, f2, b2, t, t0 + t < hi, RANK0, RANK1, RANK2,
                                 GROUP, CW64, SW64, ASM)
        f0, b0, f1, b1, f2, b2 = _merged_index(i0, m0, i1, m1, i2, m2, row, t0 + BLOCK, hi, RANK0, RANK1, RANK2, BLOCK)
        return cw, sw, f0, b0, f1, b1, f2, b2

    @triton.jit
    def _merged_words(p0, s0, i0, m0, p1, s1, i1, m1, p2, s2, i2, m2, row, t0, hi, t, inside, RANK0: tl.constexpr,
                      RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr, BLOCK: tl.constexpr,
                      CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """Each token's residual code word and scale word ([BLOCK], zeros without an entry) over the levels, each
        level's tile index read just before its entries."""
        cw = _as_word(tl.zeros(t.shape, tl.uint32), CW64)
        sw = _as_word(tl.zeros(t.shape, tl.uint32), SW64)
        one, two = _level_index(i0, m0, row, t0, hi, RANK0, BLOCK)
        cw, sw = _level_entries(p0, s0, one, two, t, inside, cw, sw, RANK0, GROUP, CW64, SW64, ASM)
        one, two = _level_index(i1, m1, row, t0, hi, RANK1, BLOCK)
        cw, sw = _level_entries(p1, s1, one, two, t, inside, cw, sw, RANK1, GROUP, CW64, SW64, ASM)
        one, two = _level_index(i2, m2, row, t0, hi, RANK2, BLOCK)
        cw, sw = _level_entries(p2, s2, one, two, t, inside, cw, sw, RANK2, GROUP, CW64, SW64, ASM)
        return cw, sw

    @triton.jit
    def _words_step(kcw, ks, vcw, vs, tok, inside, j, RW: tl.constexpr, w_st, s_st, VALUES: tl.constexpr):
        """A step's key and value codes as 32-bit words [BLOCK, RW'] (``RW`` real words a token) and their scales
        (float16 [BLOCK], one a token), as loaded; without ``VALUES`` the keys' again in the values' place (not read)."""
        ok = inside[:, None] & (j < RW)[None, :]
        kw = tl.load(kcw + tok[:, None] * w_st + j[None, :], mask=ok, other=0)
        ksc = tl.load(ks + tok * s_st, mask=inside, other=0.0)
        vw, vsc = kw, ksc
        if VALUES:
            vw = tl.load(vcw + tok[:, None] * w_st + j[None, :], mask=ok, other=0)
            vsc = tl.load(vs + tok * s_st, mask=inside, other=0.0)
        return kw, ksc, vw, vsc

    @triton.jit
    def _query_products(q, kb_rows, kres, qk_scale, k_gate, RMAX: tl.constexpr, RP: tl.constexpr, G: tl.constexpr):
        """The query ``q`` [D, G] (as loaded) in coefficient space: ``qp`` [RC, G] by the basis rows ``kb_rows``, ``qr``
        [RP, G] by the residual basis's rows ``kres`` times the gate (zeros without residuals), both float16."""
        q16 = (q.to(tl.float32) * qk_scale).to(tl.float16)
        qp = tl.dot(kb_rows.to(tl.float16), q16).to(tl.float16)
        qr = tl.zeros((RP, G), dtype=tl.float16)
        if RMAX > 0:
            qr = (tl.dot(kres.to(tl.float16), q16) * k_gate).to(tl.float16)
        return qp, qr

    @triton.jit
    def _tiles_kernel(
        q_ptr, seg_ptr, start_ptr,
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, c_sb, c_sh, c_st, s_sb, s_sh, s_st,
        kb_ptr, vb_ptr, b_sb, b_sh, b_sv, b_sr,
        krb_ptr, vrb_ptr, rb_sb, rb_sh, rb_sr, kg_ptr, vg_ptr,
        k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm,
        m_ptr, l_ptr, acc_ptr, partials, H, tiles, qk_scale, trace_ptr,
        GQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
        RP: tl.constexpr, RMAX: tl.constexpr, RANK0: tl.constexpr, RANK1: tl.constexpr, RANK2: tl.constexpr,
        GROUP: tl.constexpr, K_GATES: tl.constexpr, V_GATES: tl.constexpr, BLOCK: tl.constexpr,
        ASM: tl.constexpr, COLUMNS: tl.constexpr, AHEAD: tl.constexpr, VALUES: tl.constexpr = True,
        PDL: tl.constexpr = False, BYTES: tl.constexpr = False, ROWS: tl.constexpr = False,
        WORDS: tl.constexpr = 0, INDEX: tl.constexpr = False, QUERY_LATE: tl.constexpr = False,
        L2AHEAD: tl.constexpr = 0, TRACE: tl.constexpr = 0, SEG_MAJOR: tl.constexpr = False,
    ):
        """One program per (segment, batch row x KV head), as the gather kernel's (its arguments, in the same order,
        are documented there); ``G`` tile columns for the ``GQ`` query heads, ``RMAX`` the largest level's rank,
        ``RP`` its padding (a power of two >= 16), ``GROUP`` the int4 channels per scale of every level, ``ASM``:
        hardware population counts (a GPU). Two ways of reading the residual words, each a switch
        (:data:`~kvweave.kernels.depthweave_decode.TILES_COLUMNS`, ``TILES_AHEAD``): ``COLUMNS`` keeps a step's tokens
        as a column [BLOCK, 1] from the tile index to the residual tile, so the words are loaded in the layout the tile
        is made in, each thread holding whole rows: no layout conversion of the words, and each column's shift is known
        when the kernel is built; ``AHEAD`` loads each step's words during the step before (the tile index and the
        entries it points to are two loads in a chain; read a step ahead, their latency overlaps a step's products).
        Without ``VALUES`` only each slot's maximum and sum are written (a flush's attention statistics,
        :func:`~kvweave.kernels.depthweave_decode.fused_packed_logsumexp`): no value coefficient, residual word or
        output is read, multiplied or stored. ``BYTES`` (a GPU): the int8 coefficients made float16 four a register by
        byte permutes (:func:`_coefficients`), the same numbers as a conversion a code. ``ROWS``: the value coefficients
        loaded token-major as the keys' are and transposed once float16 (a 16-bit transpose is the matrix loads' own;
        int8 codes loaded transposed move through shared memory a byte at a time). ``WORDS`` (one scale a token, values
        token-major): the codes loaded as 32-bit words, four a word, and made float16 by :func:`_word_coefficients`,
        the keys' and the values' together at the step's start (1) or during the step before (2). ``INDEX`` (with
        ``AHEAD``): the tile index read two steps ahead, so that a step's two loads in a chain (index, then entries) each
        have a step's products to hide behind. ``QUERY_LATE``: the query's products made after the first step's loads are
        issued, not before (their loads wait behind the products' operands otherwise). ``L2AHEAD`` (a GPU): each step's
        coefficient codes and scales asked of the L2 cache that many steps ahead (:mod:`kvweave.kernels.prefetch_triton`).
        ``TRACE``: each program's start, end and SM written to ``trace_ptr`` (:mod:`kvweave.kernels.timeline`; a
        placeholder otherwise). ``SEG_MAJOR``: the grid is (B x H, S), the last segments of every row launched last
        (:mod:`kvweave.kernels.tiles_tail`)."""
        if TRACE:
            begin_ns, begin_cycles = _begin_stamp()
        seg, bh, b, h, lo, hi, version, first_valid, k_gate, v_gate = _program(seg_ptr, start_ptr, kg_ptr, vg_ptr, H,
                                                                               K_GATES, V_GATES, SEG_MAJOR)
        ONE_SCALE: tl.constexpr = RB >= R
        CW64: tl.constexpr = RMAX > 8  # a code word of 16 nibbles
        SW64: tl.constexpr = RMAX // GROUP > 2  # a scale word of 4 halves
        gi = tl.minimum(tl.arange(0, G), GQ - 1)  # the query head of each column (padding: the last one)
        g_ok = tl.arange(0, G) < GQ
        r = tl.arange(0, RC)
        d = tl.arange(0, D)
        t = tl.arange(0, BLOCK)
        b64 = b.to(tl.int64)
        # the query in coefficient space, columns the query heads: qp = P_v q^T [RC, G], qr = g R q^T [RP, G]
        q = tl.load(q_ptr + (bh * GQ + gi)[None, :] * D + d[:, None])  # [D, G]
        kb_rows = _rows(kb_ptr + b64 * b_sb + h * b_sh + version * b_sv, b_sr, R, RC, D)
        kres = 0.0
        if RMAX > 0:  # the residual basis's rows where the key tile has their coordinates (_residual_tile)
            kres = _level_rows(krb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, RP, D)
        if not QUERY_LATE:
            qp, qr = _query_products(q, kb_rows, kres, qk_scale, k_gate, RMAX, RP, G)

        kc = kc_ptr + b64 * c_sb + h * c_sh
        vc = vc_ptr + b64 * c_sb + h * c_sh
        ks = ks_ptr + b64 * s_sb + h * s_sh
        vs = vs_ptr + b64 * s_sb + h * s_sh
        row = bh * tiles
        m_i = tl.full((G,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((BLOCK, G), dtype=tl.float32)  # per slot: summed once after the loop
        acc_c = tl.zeros((RC, G), dtype=tl.float32)
        acc_r = tl.zeros((RP, G), dtype=tl.float32)
        tw = t  # the tokens as the residual words are read: a vector, or a column with COLUMNS
        if COLUMNS:
            tw = t[:, None]
        kcw = _as_word(tl.zeros(tw.shape, tl.uint32), CW64)  # the words read ahead (AHEAD): keys', values'
        ksw = _as_word(tl.zeros(tw.shape, tl.uint32), SW64)
        vcw = kcw
        vsw = ksw
        if INDEX and AHEAD and RMAX > 0:  # the first step's words; the second step's tile index
            ka0, kz0, ka1, kz1, ka2, kz2 = _merged_index(k0_ts, k0_tm, k1_ts, k1_tm, k2_ts, k2_tm, row, lo, hi, RANK0,
                                                         RANK1, RANK2, BLOCK)
            kcw, ksw, ka0, kz0, ka1, kz1, ka2, kz2 = _entries_ahead(
                k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm, ka0, kz0, ka1, kz1,
                ka2, kz2, row, lo, hi, tw, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64, SW64, ASM)
            if VALUES:
                va0, vz0, va1, vz1, va2, vz2 = _merged_index(v0_ts, v0_tm, v1_ts, v1_tm, v2_ts, v2_tm, row, lo, hi,
                                                             RANK0, RANK1, RANK2, BLOCK)
                vcw, vsw, va0, vz0, va1, vz1, va2, vz2 = _entries_ahead(
                    v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm, va0, vz0, va1,
                    vz1, va2, vz2, row, lo, hi, tw, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64, SW64, ASM)
        elif AHEAD and RMAX > 0:
            kcw, ksw = _merged_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
                                     row, lo, hi, tw, lo + tw < hi, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64, SW64, ASM)
            if VALUES:
                vcw, vsw = _merged_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts,
                                         v2_tm, row, lo, hi, tw, lo + tw < hi, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64,
                                         SW64, ASM)
        RW: tl.constexpr = R // 4
        jw = tl.arange(0, RC // 4)
        w_st = c_st // 4
        kcw_ptr = kc.to(tl.pointer_type(tl.int32), bitcast=True)
        vcw_ptr = vc.to(tl.pointer_type(tl.int32), bitcast=True)
        if WORDS == 2:
            nkw, nks, nvw, nvs = _words_step(kcw_ptr, ks, vcw_ptr, vs, lo + t, lo + t < hi, jw, RW, w_st, s_st, VALUES)
        PREF: tl.constexpr = L2AHEAD if ASM else 0
        for j in tl.static_range(1, PREF):  # the first steps' lines (the loop asks for step t0 + PREF's)
            _prefetch_coefficients(kc, vc, ks, vs, lo + j * BLOCK, hi, c_st, s_st, BLOCK, RC, VALUES)
        if QUERY_LATE:  # the query's products once the first step's loads are out
            qp, qr = _query_products(q, kb_rows, kres, qk_scale, k_gate, RMAX, RP, G)
        for t0 in range(lo, hi, BLOCK):
            if PREF > 0:
                _prefetch_coefficients(kc, vc, ks, vs, t0 + PREF * BLOCK, hi, c_st, s_st, BLOCK, RC, VALUES)
            tok = t0 + t
            inside = tok < hi
            ok = inside & (tok >= first_valid)
            if WORDS == 2:  # this step's words, loaded in the step before; the next step's issued now
                kw, ksc, vw, vsc = nkw, nks, nvw, nvs
                nkw, nks, nvw, nvs = _words_step(kcw_ptr, ks, vcw_ptr, vs, tok + BLOCK, tok + BLOCK < hi, jw, RW, w_st,
                                                 s_st, VALUES)
            elif WORDS == 1:
                kw, ksc, vw, vsc = _words_step(kcw_ptr, ks, vcw_ptr, vs, tok, inside, jw, RW, w_st, s_st, VALUES)
            k_cw, k_sw, v_cw, v_sw = kcw, ksw, vcw, vsw
            if INDEX and AHEAD and RMAX > 0:  # the next step's words by the index read a step ago; the index after it
                after = t0 + BLOCK
                kcw, ksw, ka0, kz0, ka1, kz1, ka2, kz2 = _entries_ahead(
                    k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm, ka0, kz0, ka1,
                    kz1, ka2, kz2, row, after, hi, tw, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64, SW64, ASM)
                if VALUES:
                    vcw, vsw, va0, vz0, va1, vz1, va2, vz2 = _entries_ahead(
                        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm, va0, vz0,
                        va1, vz1, va2, vz2, row, after, hi, tw, RANK0, RANK1, RANK2, GROUP, BLOCK, CW64, SW64, ASM)
            elif AHEAD and RMAX > 0:  # the next step's words, issued before this step's products
                after = t0 + BLOCK
                kcw, ksw = _merged_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts,
                                         k2_tm, row, after, hi, tw, after + tw < hi, RANK0, RANK1, RANK2, GROUP, BLOCK,
                                         CW64, SW64, ASM)
                if VALUES:
                    vcw, vsw = _merged_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc,
                                             v2_ts, v2_tm, row, after, hi, tw, after + tw < hi, RANK0, RANK1, RANK2,
                                             GROUP, BLOCK, CW64, SW64, ASM)
            if WORDS > 0:
                s = tl.dot(_word_coefficients(kw, BYTES), qp) * ksc.to(tl.float32)[:, None]
            else:
                ck = tl.load(kc + tok[:, None] * c_st + r[None, :], mask=inside[:, None] & (r < R)[None, :], other=0)
                if ONE_SCALE:
                    k_scale = tl.load(ks + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                    s = tl.dot(_coefficients(ck, BYTES), qp) * k_scale[:, None]  # [BLOCK, G]
                else:
                    kbs = tl.load(ks + tok[:, None] * s_st + (r // RB)[None, :],
                                  mask=inside[:, None] & (r < R)[None, :], other=0.0)
                    s = tl.dot(_coefficients(ck, BYTES) * kbs.to(tl.float16), qp)
            if RMAX > 0:
                if not AHEAD:
                    k_cw, k_sw = _merged_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc,
                                               k2_ts, k2_tm, row, t0, hi, tw, t0 + tw < hi, RANK0, RANK1, RANK2, GROUP,
                                               BLOCK, CW64, SW64, ASM)
                s = tl.dot(_residual_tile(k_cw, k_sw, RMAX, RP, GROUP, COLUMNS), qr, s)
            s = tl.where(ok[:, None], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[:, None], tl.exp2(s - m_new[None, :]), 0.0)  # [BLOCK, G]
            l_i = l_i * alpha[None, :] + p
            m_i = m_new
            if VALUES:  # the values' coefficients and residuals times the probabilities
                if WORDS > 0:
                    acc_c = tl.dot(tl.trans(_word_coefficients(vw, BYTES)),
                                   (p * vsc.to(tl.float32)[:, None]).to(tl.float16), acc_c * alpha[None, :])
                else:
                    if ROWS:  # loaded as the keys' are, made float16, then transposed (16-bit: by the matrix loads)
                        cv16 = tl.trans(_coefficients(tl.load(vc + tok[:, None] * c_st + r[None, :],
                                                              mask=inside[:, None] & (r < R)[None, :], other=0), BYTES))
                    else:
                        cv = tl.load(vc + tok[None, :] * c_st + r[:, None], mask=inside[None, :] & (r < R)[:, None],
                                     other=0)
                        cv16 = _coefficients(cv, BYTES)
                    if ONE_SCALE:
                        v_scale = tl.load(vs + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                        acc_c = tl.dot(cv16, (p * v_scale[:, None]).to(tl.float16), acc_c * alpha[None, :])
                    else:
                        vbs = tl.load(vs + tok[None, :] * s_st + (r // RB)[:, None],
                                      mask=inside[None, :] & (r < R)[:, None], other=0.0)
                        acc_c = tl.dot(cv16 * vbs.to(tl.float16), p.to(tl.float16), acc_c * alpha[None, :])
                if RMAX > 0:
                    if not AHEAD:
                        v_cw, v_sw = _merged_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk,
                                                   v2_sc, v2_ts, v2_tm, row, t0, hi, tw, t0 + tw < hi, RANK0, RANK1,
                                                   RANK2, GROUP, BLOCK, CW64, SW64, ASM)
                    e = _residual_tile(v_cw, v_sw, RMAX, RP, GROUP, COLUMNS)
                    acc_r = tl.dot(tl.trans(e), p.to(tl.float16), acc_r * alpha[None, :])

        slot = (bh * GQ + gi) * partials + seg
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, tl.sum(l_i, axis=0), mask=g_ok)
        if VALUES:
            # back to head_dim: P_v^T (sum p c) + g R^T (sum p e), [D, G]
            vb = vb_ptr + b64 * b_sb + h * b_sh + version * b_sv
            out = tl.dot(tl.trans(_rows(vb, b_sr, R, RC, D).to(tl.float16)), acc_c.to(tl.float16))
            if RMAX > 0:
                vres = _level_rows(vrb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, RP, D).to(tl.float16)
                out = tl.dot(tl.trans(vres), (acc_r * v_gate).to(tl.float16), out)
            tl.store(acc_ptr + slot[None, :] * D + d[:, None], out, mask=g_ok[None, :])
        if PDL:  # launched as the exact-window pass's programmatic dependent: done only once that pass is (the combine
            # after this kernel then reads both passes' partials)
            gdc_wait()
        if TRACE:
            _end_stamp(trace_ptr, tl.program_id(1) * tl.num_programs(0) + tl.program_id(0), begin_ns, begin_cycles,
                       begin_cycles)
