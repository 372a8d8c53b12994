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
    from kvweave.kernels.decode_triton import _popcount, _program, _rows

    @triton.jit
    def _popc(x, ASM: tl.constexpr):
        """Set bits of each uint32 in ``x`` (int32): one instruction on a GPU (``ASM``)."""
        if ASM:
            return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
        return _popcount(x).to(tl.int32)

    @triton.jit
    def _word_ptr(ptr, BITS: tl.constexpr):
        """``ptr`` as a pointer to unsigned words of ``BITS`` (8, 16, 32 or 64) bits."""
        if BITS == 8:
            out = ptr.to(tl.pointer_type(tl.uint8), bitcast=True)
        elif BITS == 16:
            out = ptr.to(tl.pointer_type(tl.uint16), bitcast=True)
        elif BITS == 32:
            out = ptr.to(tl.pointer_type(tl.uint32), bitcast=True)
        else:
            out = ptr.to(tl.pointer_type(tl.uint64), bitcast=True)
        return out

    @triton.jit
    def _as_word(x, WIDE: tl.constexpr):
        """``x`` as the merged words' type: uint64 with ``WIDE``, else uint32."""
        if WIDE:
            out = x.to(tl.uint64)
        else:
            out = x.to(tl.uint32)
        return out

    @triton.jit
    def _level_words(pk_ptr, sc_ptr, first, mask, t, inside, cw, sw, RANK: tl.constexpr, GROUP: tl.constexpr,
                     CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """``cw``, ``sw`` with one level's code word and scale word put in at the tokens ``t`` (their places in one
        32-token tile of the index, whose first entry and bit mask are ``first`` and ``mask``) that have an entry
        there: the entry of token ``i`` is ``first + popcount(mask & (2^i - 1))``."""
        if RANK > 0:
            bit = t.to(tl.uint32)
            present = inside & (((mask >> bit) & 1) != 0)
            below = mask & ((tl.full(bit.shape, 1, tl.uint32) << bit) - 1)
            entry = first + _popc(below, ASM)  # loaded only where present: a level without entries may point nowhere
            codes = tl.load(_word_ptr(pk_ptr, RANK * 4) + entry, mask=present, other=0)
            scales = tl.load(_word_ptr(sc_ptr, 16 * (RANK // GROUP)) + entry, mask=present, other=0)
            cw = tl.where(present, _as_word(codes, CW64), cw)
            sw = tl.where(present, _as_word(scales, SW64), sw)
        return cw, sw

    @triton.jit
    def _tile_words(ts_ptr, tm_ptr, pk_ptr, sc_ptr, tile, live, t, inside, cw, sw, RANK: tl.constexpr,
                    GROUP: tl.constexpr, CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """:func:`_level_words` for the tokens ``t`` of tile ``tile`` of one level's index, read as two scalars where
        ``live`` (the segment holds the tile)."""
        if RANK > 0:
            first = tl.load(ts_ptr + tile, mask=live, other=0)
            mask = tl.load(tm_ptr + tile, mask=live, other=0).to(tl.uint32, bitcast=True)
            cw, sw = _level_words(pk_ptr, sc_ptr, first, mask, t, inside, cw, sw, RANK, GROUP, CW64, SW64, ASM)
        return cw, sw

    @triton.jit
    def _merged_words(p0, s0, i0, m0, p1, s1, i1, m1, p2, s2, i2, m2, tile, live, t, inside, RANK0: tl.constexpr,
                      RANK1: tl.constexpr, RANK2: tl.constexpr, GROUP: tl.constexpr, CW64: tl.constexpr,
                      SW64: tl.constexpr, ASM: tl.constexpr):
        """Each token's residual code word and scale word (zeros without an entry) over the levels, for the tokens
        ``t`` of the index's tile ``tile`` where ``live`` (a token has at most one entry a kind)."""
        cw = _as_word(tl.zeros(t.shape, tl.uint32), CW64)
        sw = _as_word(tl.zeros(t.shape, tl.uint32), SW64)
        cw, sw = _tile_words(i0, m0, p0, s0, tile, live, t, inside, cw, sw, RANK0, GROUP, CW64, SW64, ASM)
        cw, sw = _tile_words(i1, m1, p1, s1, tile, live, t, inside, cw, sw, RANK1, GROUP, CW64, SW64, ASM)
        cw, sw = _tile_words(i2, m2, p2, s2, tile, live, t, inside, cw, sw, RANK2, GROUP, CW64, SW64, ASM)
        return cw, sw

    # A pair of residual coordinates as float16 in one register: the low nibbles of two pre-shifted code words side by
    # side under the bits of float16 1024 (one byte permute, one three-input logic operation), less 1032, times the
    # low halves of two pre-shifted scale words side by side.
    _PAIR_TEXT = tl.constexpr(
        "{ .reg .b32 t, u, o; prmt.b32 t, $1, $2, 0x5410; lop3.b32 t, t, 0x000F000F, 0x64006400, 0xEA; "
        "prmt.b32 u, $3, $4, 0x5410; mov.b32 o, 0x64086408; sub.rn.f16x2 t, t, o; mul.rn.f16x2 $0, t, u; }")

    @triton.jit
    def _halves(word_a, word_b, lower, W: tl.constexpr, WIDE: tl.constexpr):
        """[P, W] 32-bit words: column ``c`` holds half ``a`` (``c < W / 2``) or ``b``'s word, its low 32 bits where
        ``lower`` [W], else (``WIDE``: 64-bit words) its high 32 bits."""
        first = (tl.arange(0, W) < W // 2)[None, :]
        if WIDE:
            a = tl.where(lower[None, :], word_a.to(tl.uint32)[:, None], (word_a >> 32).to(tl.uint32)[:, None])
            b = tl.where(lower[None, :], word_b.to(tl.uint32)[:, None], (word_b >> 32).to(tl.uint32)[:, None])
            out = tl.where(first, a, b)
        else:
            out = tl.where(first, word_a.to(tl.uint32)[:, None], word_b.to(tl.uint32)[:, None])
        return out

    @triton.jit
    def _residual_tile(cw_a, sw_a, cw_b, sw_b, RMAX: tl.constexpr, W: tl.constexpr, GROUP: tl.constexpr,
                       CW64: tl.constexpr, SW64: tl.constexpr, ASM: tl.constexpr):
        """The residual coordinates (float16) of two halves of a step's tokens as one tile [P, W]: row ``i`` holds token
        ``i`` of half ``a`` (words ``cw_a``, ``sw_a``) in columns ``c < W / 2`` and token ``i`` of half ``b`` in the
        others. Column ``c`` holds coordinate ``k = (c mod W / 2) mod RMAX`` (nibble ``k`` of the code word less 8,
        times half ``k // GROUP`` of the scale word): columns that repeat a coordinate meet zero rows of the bases,
        with nothing to clear. Coordinates past a token's rank meet a zero scale: its scale word ends there, every
        level's rank being a multiple of ``GROUP``. Each column's code and scale words come shifted to that
        coordinate as 32-bit numbers; with ``ASM`` (a GPU) each pair of a thread's adjacent elements is then made in
        one register by :data:`_PAIR_TEXT` in whichever layout the product reads the tile, rows or columns; else
        ``1024 + nibble`` is made from its bits, less 1032, one element at a time."""
        k = (tl.arange(0, W) % (W // 2)) % RMAX
        words = _halves(cw_a, cw_b, k < 8, W, CW64) >> (4 * (k % 8)).to(tl.uint32)[None, :]
        j = k // GROUP  # the coordinate's scale
        halves = _halves(sw_a, sw_b, j < 2, W, SW64) >> (16 * (j % 2)).to(tl.uint32)[None, :]
        if ASM:
            value = tl.inline_asm_elementwise(_PAIR_TEXT, "=r,r,r,r,r", [words, halves], dtype=tl.float16,
                                              is_pure=True, pack=2)
        else:
            code = ((words & 15).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
            value = code * (halves & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        return value

    @triton.jit
    def _pair_rows(base_ptr, stride_r, RANK: tl.constexpr, W: tl.constexpr, D: tl.constexpr):
        """A basis's rows for the tiles whose columns ``c`` hold coordinate ``(c mod W / 2) mod RANK``: row ``c mod
        W / 2`` of the basis where it is below ``RANK``, zeros elsewhere (the repeated columns). [W, D] float16."""
        c = tl.arange(0, W) % (W // 2)
        d = tl.arange(0, D)
        return tl.load(base_ptr + c[:, None] * stride_r + d[None, :], mask=(c < RANK)[:, None], other=0.0).to(tl.float16)

    @triton.jit
    def _tiles_kernel(
        q_ptr, seg_ptr, start_ptr,
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, c_sb, c_sh, c_st, s_sb, s_sh, s_st,
        kb_ptr, vb_ptr, b_sb, b_sh, b_sv, b_sr,
        krb_ptr, vrb_ptr, rb_sb, rb_sh, rb_sr, kg_ptr, vg_ptr,
        k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm,
        m_ptr, l_ptr, acc_ptr, partials, H, tiles, qk_scale,
        GQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
        W: tl.constexpr, RMAX: tl.constexpr, RANK0: tl.constexpr, RANK1: tl.constexpr, RANK2: tl.constexpr,
        GROUP: tl.constexpr, K_GATES: tl.constexpr, V_GATES: tl.constexpr, BLOCK: tl.constexpr,
        ASM: tl.constexpr,
    ):
        """One program per (segment, batch row x KV head), as the gather kernel's (its arguments, in the same order,
        are documented there). A step's ``BLOCK`` tokens are two halves, ``a`` (the first ``BLOCK / 2``) and ``b``;
        the tiles' rows are token pairs (token ``i`` of each half) and their ``2 G`` columns the query heads of half
        ``a``, then of half ``b`` (``G``: the ``GQ`` heads padded to a power of two >= 4; a padding column repeats the
        last real head and is never written). Each column keeps its own softmax and writes its own partial: slots
        ``2 * segment`` (half ``a``'s tokens of every step) and ``2 * segment + 1`` (half ``b``'s). ``RMAX``: the
        largest level's rank; ``W``: the residual tiles' width, twice ``RMAX`` rounded up to a power of two >= 8;
        ``GROUP``: the int4 channels per scale of every level; ``ASM``: a GPU (population counts and coordinate pairs
        in one instruction each)."""
        seg, bh, b, h, lo, hi, version, first_valid, k_gate, v_gate = _program(seg_ptr, start_ptr, kg_ptr, vg_ptr, H,
                                                                               K_GATES, V_GATES)
        ONE_SCALE: tl.constexpr = RB >= R
        CW64: tl.constexpr = RMAX > 8  # a code word of 16 nibbles
        SW64: tl.constexpr = RMAX // GROUP > 2  # a scale word of 4 halves
        HALF: tl.constexpr = BLOCK // 2
        col = tl.arange(0, 2 * G)
        in_a = col < G  # the columns of half a
        gi = tl.minimum(col % G, GQ - 1)  # the query head of each column (padding: the last one)
        g_ok = (col % G) < GQ
        r = tl.arange(0, RC)
        d = tl.arange(0, D)
        i = tl.arange(0, HALF)
        b64 = b.to(tl.int64)
        # the query in coefficient space for each half's columns: P_v q^T [RC, 2 G] with the other half's columns zero
        q = tl.load(q_ptr + (bh * GQ + gi)[None, :] * D + d[:, None]).to(tl.float32) * qk_scale  # [D, 2 G]
        q16 = q.to(tl.float16)
        kb = kb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        qp = tl.dot(_rows(kb, b_sr, R, RC, D).to(tl.float16), q16)
        qp_a = tl.where(in_a[None, :], qp, 0.0).to(tl.float16)
        qp_b = tl.where(in_a[None, :], 0.0, qp).to(tl.float16)
        qr = tl.zeros((W, 2 * G), dtype=tl.float16)
        if RMAX > 0:  # g R q^T on the residual tile's columns: half a's coordinates meet half a's query heads
            qr = tl.dot(_pair_rows(krb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, W, D), q16) * k_gate
            own = (tl.arange(0, W) < W // 2)[:, None] == in_a[None, :]
            qr = tl.where(own, qr, 0.0).to(tl.float16)

        kc = kc_ptr + b64 * c_sb + h * c_sh
        vc = vc_ptr + b64 * c_sb + h * c_sh
        ks = ks_ptr + b64 * s_sb + h * s_sh
        vs = vs_ptr + b64 * s_sb + h * s_sh
        row = bh * tiles
        m_i = tl.full((2 * G,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((HALF, 2 * G), dtype=tl.float32)  # per slot: summed once after the loop
        acc_c = tl.zeros((RC, 2 * G), dtype=tl.float32)
        acc_r = tl.zeros((W, 2 * G), dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK):
            tok_a = t0 + i
            tok_b = tok_a + HALF
            inside_a = tok_a < hi
            inside_b = tok_b < hi
            ok = tl.where(in_a[None, :], (inside_a & (tok_a >= first_valid))[:, None],
                          (inside_b & (tok_b >= first_valid))[:, None])
            ck_a = tl.load(kc + tok_a[:, None] * c_st + r[None, :], mask=inside_a[:, None] & (r < R)[None, :], other=0)
            ck_b = tl.load(kc + tok_b[:, None] * c_st + r[None, :], mask=inside_b[:, None] & (r < R)[None, :], other=0)
            if ONE_SCALE:
                ks_a = tl.load(ks + tok_a * s_st, mask=inside_a, other=0.0).to(tl.float32)
                ks_b = tl.load(ks + tok_b * s_st, mask=inside_b, other=0.0).to(tl.float32)
                s = tl.dot(ck_b.to(tl.float16), qp_b, tl.dot(ck_a.to(tl.float16), qp_a))
                s = s * tl.where(in_a[None, :], ks_a[:, None], ks_b[:, None])  # [HALF, 2 G]
            else:
                kbs_a = tl.load(ks + tok_a[:, None] * s_st + (r // RB)[None, :],
                                mask=inside_a[:, None] & (r < R)[None, :], other=0.0)
                kbs_b = tl.load(ks + tok_b[:, None] * s_st + (r // RB)[None, :],
                                mask=inside_b[:, None] & (r < R)[None, :], other=0.0)
                s = tl.dot(ck_a.to(tl.float16) * kbs_a.to(tl.float16), qp_a)
                s = tl.dot(ck_b.to(tl.float16) * kbs_b.to(tl.float16), qp_b, s)
            if RMAX > 0:
                tile = row + t0 // 32
                tile_b = tile + (HALF // 32)  # a 32-token step's halves share a tile of the index
                cw_a, sw_a = _merged_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts,
                                           k2_tm, tile, True, i, inside_a, RANK0, RANK1, RANK2, GROUP, CW64, SW64, ASM)
                cw_b, sw_b = _merged_words(k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts,
                                           k2_tm, tile_b, t0 + HALF < hi, (i + HALF) % 32, inside_b, RANK0, RANK1, RANK2, GROUP, CW64,
                                           SW64, ASM)
                s = tl.dot(_residual_tile(cw_a, sw_a, cw_b, sw_b, RMAX, W, GROUP, CW64, SW64, ASM), qr, s)
            s = tl.where(ok, s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok, tl.exp2(s - m_new[None, :]), 0.0)  # [HALF, 2 G]
            l_i = l_i * alpha[None, :] + p
            m_i = m_new
            cv_a = tl.load(vc + tok_a[None, :] * c_st + r[:, None], mask=inside_a[None, :] & (r < R)[:, None], other=0)
            cv_b = tl.load(vc + tok_b[None, :] * c_st + r[:, None], mask=inside_b[None, :] & (r < R)[:, None], other=0)
            if ONE_SCALE:
                vs_a = tl.load(vs + tok_a * s_st, mask=inside_a, other=0.0).to(tl.float32)
                vs_b = tl.load(vs + tok_b * s_st, mask=inside_b, other=0.0).to(tl.float32)
                pv = p * tl.where(in_a[None, :], vs_a[:, None], vs_b[:, None])
                acc_c = tl.dot(cv_a.to(tl.float16), tl.where(in_a[None, :], pv, 0.0).to(tl.float16), acc_c * alpha[None, :])
                acc_c = tl.dot(cv_b.to(tl.float16), tl.where(in_a[None, :], 0.0, pv).to(tl.float16), acc_c)
            else:
                vbs_a = tl.load(vs + tok_a[None, :] * s_st + (r // RB)[:, None],
                                mask=inside_a[None, :] & (r < R)[:, None], other=0.0)
                vbs_b = tl.load(vs + tok_b[None, :] * s_st + (r // RB)[:, None],
                                mask=inside_b[None, :] & (r < R)[:, None], other=0.0)
                acc_c = tl.dot(cv_a.to(tl.float16) * vbs_a.to(tl.float16), tl.where(in_a[None, :], p, 0.0).to(tl.float16),
                               acc_c * alpha[None, :])
                acc_c = tl.dot(cv_b.to(tl.float16) * vbs_b.to(tl.float16), tl.where(in_a[None, :], 0.0, p).to(tl.float16),
                               acc_c)
            if RMAX > 0:
                cw_a, sw_a = _merged_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts,
                                           v2_tm, tile, True, i, inside_a, RANK0, RANK1, RANK2, GROUP, CW64, SW64, ASM)
                cw_b, sw_b = _merged_words(v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts,
                                           v2_tm, tile_b, t0 + HALF < hi, (i + HALF) % 32, inside_b, RANK0, RANK1, RANK2, GROUP, CW64,
                                           SW64, ASM)
                e = _residual_tile(cw_a, sw_a, cw_b, sw_b, RMAX, W, GROUP, CW64, SW64, ASM)
                acc_r = tl.dot(tl.trans(e), p.to(tl.float16), acc_r * alpha[None, :])  # half-crossing sums cleared below

        slot = (bh * GQ + gi) * partials + 2 * seg + (col >= G).to(tl.int32)
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, tl.sum(l_i, axis=0), mask=g_ok)
        # back to head_dim: P_v^T (sum p c) + g R^T (sum p e), [D, 2 G]
        vb = vb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        out = tl.dot(tl.trans(_rows(vb, b_sr, R, RC, D).to(tl.float16)), acc_c.to(tl.float16))
        if RMAX > 0:
            own = (tl.arange(0, W) < W // 2)[:, None] == in_a[None, :]
            acc_r = tl.where(own, acc_r * v_gate, 0.0)
            out = tl.dot(tl.trans(_pair_rows(vrb_ptr + b64 * rb_sb + h * rb_sh, rb_sr, RMAX, W, D)),
                         acc_r.to(tl.float16), out)
        tl.store(acc_ptr + slot[None, :] * D + d[:, None], out, mask=g_ok[None, :])
