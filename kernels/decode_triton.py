"""The ``@triton.jit`` kernels of the fused decode attention (launched by
:mod:`kvweave.kernels.depthweave_decode`, which checks their inputs).

Three passes: the packed-token pass (:func:`_packed_split_kernel`, one program per segment of packed
tokens and per batch row x KV head), the exact-window pass (:func:`_exact_split_kernel`) and the combine
pass that merges their partial (max, sum, output) triples (:func:`_combine_kernel`, two loops over a query head's
slots; or :func:`_combine_columns_kernel`, one step over them for a slice of the columns). The packed formats
read are ``int8-block.v1`` (coefficients) and ``int4-group.v1`` (residual coordinates), described in
:mod:`kvweave.kernels.formats`. Without triton installed the module defines no kernel (``triton`` is None).
"""

from __future__ import annotations

try:  # the kernel needs triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    triton = None
    tl = None


if triton is not None:
    from kvweave.kernels.grid_dependency_triton import gdc_launch_dependents

    @triton.jit
    def _popcount(x):
        """Set bits of each uint32 in ``x``."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return (x * 0x01010101) >> 24

    @triton.jit
    def _level_values(pk_ptr, sc_ptr, ts_ptr, tm_ptr, row, tiles, tok, inside,
                      RANK: tl.constexpr, GROUP: tl.constexpr, RP: tl.constexpr, BLOCK_T: tl.constexpr):
        """One level's residual coordinates of tokens ``tok`` [T] as float16 [T, RP]: coordinate ``k`` in
        column ``k * RP / RANK`` (zeros between; see :func:`_level_rows`), zero for tokens without an entry.
        The tile index gives each token's entry directly: ``start + popcount(mask & (2^i - 1))``."""
        tile = tok // 32
        bit = tok % 32
        first = tl.load(ts_ptr + row * tiles + tile, mask=inside, other=0)
        mask = tl.load(tm_ptr + row * tiles + tile, mask=inside, other=0).to(tl.uint32, bitcast=True)
        present = inside & (((mask >> bit.to(tl.uint32)) & 1) != 0)
        below = (((1 << bit) - 1).to(tl.uint32, bitcast=True)) & mask
        entry = (first + _popcount(below).to(tl.int32)).to(tl.int64)
        c = tl.arange(0, RP)
        step: tl.constexpr = RP // RANK
        k = c // step  # the coordinate column c holds (when step divides c)
        used = present[:, None] & ((c % step) == 0)[None, :]
        byte = tl.load(pk_ptr + entry[:, None] * (RANK // 2) + (k // 2)[None, :], mask=used, other=136).to(tl.int32)
        code = ((byte >> ((k % 2) * 4)[None, :]) & 15) - 8
        scale = tl.load(sc_ptr + entry[:, None] * (RANK // GROUP) + (k // GROUP)[None, :], mask=used, other=0.0)
        values = tl.where(used, code.to(tl.float32) * scale.to(tl.float32), 0.0).to(tl.float16)
        return values

    @triton.jit
    def _level_rows(base_ptr, stride_r, RANK: tl.constexpr, RP: tl.constexpr, D: tl.constexpr):
        """The residual basis rows of one level laid out as :func:`_level_values` lays out coordinates:
        column ``c`` holds row ``c * RANK / RP`` when ``RP / RANK`` divides ``c``, else zeros. [RP, D] float32."""
        c = tl.arange(0, RP)
        d = tl.arange(0, D)
        step = RP // RANK
        used = (c % step) == 0
        return tl.load(base_ptr + (c // step)[:, None] * stride_r + d[None, :], mask=used[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _codes(c_ptr, tok, inside, c_st, R: tl.constexpr, RC: tl.constexpr):
        """int8 coefficient codes [T, RC] of tokens ``tok`` as float16 (exact), zero beyond R and outside."""
        r = tl.arange(0, RC)
        if R == RC:
            codes = tl.load(c_ptr + tok[:, None] * c_st + r[None, :], mask=inside[:, None], other=0)
        else:
            codes = tl.load(c_ptr + tok[:, None] * c_st + r[None, :], mask=inside[:, None] & (r < R)[None, :], other=0)
        return codes.to(tl.float16)

    @triton.jit
    def _block_scales(s_ptr, tok, inside, s_st, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr):
        """Per-channel scales [T, RC] (float16) for coefficients with several scale blocks per token."""
        r = tl.arange(0, RC)
        return tl.load(s_ptr + tok[:, None] * s_st + (r // RB)[None, :], mask=inside[:, None] & (r < R)[None, :], other=0.0).to(tl.float16)

    @triton.jit
    def _rows(base_ptr, stride_r, R: tl.constexpr, RC: tl.constexpr, D: tl.constexpr):
        """The first R rows of a basis [R, D] (row stride ``stride_r``), zero-padded to RC rows, float32."""
        r = tl.arange(0, RC)
        d = tl.arange(0, D)
        return tl.load(base_ptr + r[:, None] * stride_r + d[None, :], mask=(r < R)[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _program(seg_ptr, start_ptr, kg_ptr, vg_ptr, H, K_GATES: tl.constexpr, V_GATES: tl.constexpr,
                 SEG_MAJOR: tl.constexpr = False):
        """What a packed-token program (grid (S, B * H), or (B * H, S) with ``SEG_MAJOR``) works on: its segment, batch
        row x KV head, batch row, KV head, the segment's tokens and basis version, the row's first attended position,
        and the head's residual gates (1 where none are given)."""
        seg = tl.program_id(1) if SEG_MAJOR else tl.program_id(0)
        bh = tl.program_id(0) if SEG_MAJOR else tl.program_id(1)
        b = bh // H
        h = bh % H
        k_gate = 1.0
        v_gate = 1.0
        if K_GATES:
            k_gate = tl.load(kg_ptr + h)
        if V_GATES:
            v_gate = tl.load(vg_ptr + h)
        return (seg, bh, b, h, tl.load(seg_ptr + seg * 3), tl.load(seg_ptr + seg * 3 + 1), tl.load(seg_ptr + seg * 3 + 2),
                tl.load(start_ptr + b), k_gate, v_gate)

    # The packed-token pass. One program per (segment, batch row x KV head): grid (S, B * H). It keeps an
    # online softmax (base 2) over the segment's tokens for the GQ query heads of its KV head, accumulates
    # the probabilities times the value coefficients ([GQ, r]) and times each level's residual coordinates
    # ([GQ, RP]) in coefficient space, and projects them to head_dim once at the end; it writes one
    # partial (max, sum, output) per query head into slot (row * GQ + g) * partials + segment.
    # Strides are in elements; a stride argument is named <tensor>_s<axis> (b batch, h head, t token,
    # v version, r row). Argument legend:
    @triton.jit
    def _packed_split_kernel(
        # the query and where to read
        q_ptr,  # [B, Hq, D] queries (contiguous; Hq = H * GQ), scaled here by qk_scale
        seg_ptr,  # int32 [S, 3] segments: first token, end token (exclusive), basis version
        start_ptr,  # int32 [B] first logical position each row attends to (left padding, sliding windows)
        # int8-block.v1 coefficients: codes int8 [B, H, T, R], scales [B, H, T, R / RB]; keys and values
        # share one layout (c_s* strides of the codes, s_s* of the scales)
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, c_sb, c_sh, c_st, s_sb, s_sh, s_st,
        # bases [B, H, V, R, D] of keys and values (float16, contiguous along D; one layout)
        kb_ptr, vb_ptr, b_sb, b_sh, b_sv, b_sr,
        # residual bases [B, H, Rmax, D] of keys and values (contiguous along D; placeholders without
        # levels), then the residual gates float32 [H] (read when K_GATES / V_GATES)
        krb_ptr, vrb_ptr, rb_sb, rb_sh, rb_sr, kg_ptr, vg_ptr,
        # residual level i of the keys (k) and values (v), int4-group.v1: *_pk codes uint8 [N_i, RANK_i / 2],
        # *_sc scales [N_i, RANK_i / GROUP_i], *_ts / *_tm the tile index int32 [B * H, tiles] (first entry
        # of each 32-token tile, bit mask of its tokens that have one); placeholders when RANK_i is 0
        k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm,
        # outputs: float32 [B * Hq * partials] max (log2 domain) and sum, float32 [B * Hq * partials, D]
        # unnormalized output of each partial; partials = slots per query head; H = KV heads; tiles = T / 32
        # (the tile index's row length); qk_scale = softmax scale * log2(e)
        m_ptr, l_ptr, acc_ptr, partials, H, tiles, qk_scale,
        # GQ query heads per KV head, GQP padded (power of two >= 16: tensor-core rows); D head_dim;
        # R coefficient rank, RC padded (power of two >= 16); RB coefficient channels per int8 scale
        GQ: tl.constexpr, GQP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
        # RP: width of the residual tiles, the largest level's rank padded (power of two >= 16)
        RP: tl.constexpr,
        # rank of residual level i (0: absent) and its int4 channels per scale
        RANK0: tl.constexpr, GROUP0: tl.constexpr, RANK1: tl.constexpr, GROUP1: tl.constexpr,
        RANK2: tl.constexpr, GROUP2: tl.constexpr,
        # whether gates are given; tokens per loop iteration (a multiple of 32)
        K_GATES: tl.constexpr, V_GATES: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        seg, bh, b, h, lo, hi, version, first_valid, k_gate, v_gate = _program(seg_ptr, start_ptr, kg_ptr, vg_ptr, H,
                                                                               K_GATES, V_GATES)
        ONE_SCALE: tl.constexpr = RB >= R  # one scale per token: applied to the dot products, codes stay exact

        g = tl.arange(0, GQP)
        t = tl.arange(0, BLOCK_T)
        g_ok = g < GQ
        b64 = b.to(tl.int64)
        # q in coefficient space: q P_v^T [GQP, RC]; per residual level q R^T in that level's column layout
        # (D in chunks of 32 columns, so that no [GQP, D] tile is held)
        q_row = q_ptr + (bh * GQ + g)[:, None] * D
        kb = kb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        krb = krb_ptr + b64 * rb_sb + h * rb_sh
        qp = tl.zeros((GQP, RC), dtype=tl.float32)
        qr0 = tl.zeros((GQP, RP), dtype=tl.float32)
        qr1 = tl.zeros((GQP, RP), dtype=tl.float32)
        qr2 = tl.zeros((GQP, RP), dtype=tl.float32)
        for d0 in tl.static_range(0, D, 32):
            dc = d0 + tl.arange(0, 32)
            qc = (tl.load(q_row + dc[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            qp += tl.dot(qc, tl.trans(_rows(kb + d0, b_sr, R, RC, 32).to(tl.float16)))
            if RANK0 > 0:
                qr0 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK0, RP, 32).to(tl.float16)))
            if RANK1 > 0:
                qr1 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK1, RP, 32).to(tl.float16)))
            if RANK2 > 0:
                qr2 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK2, RP, 32).to(tl.float16)))
        qp = qp.to(tl.float16)
        qr0 = (qr0 * k_gate).to(tl.float16)
        qr1 = (qr1 * k_gate).to(tl.float16)
        qr2 = (qr2 * k_gate).to(tl.float16)
        acc_r0 = tl.zeros((GQP, RP), dtype=tl.float32)
        acc_r1 = tl.zeros((GQP, RP), dtype=tl.float32)
        acc_r2 = tl.zeros((GQP, RP), dtype=tl.float32)

        m_i = tl.full((GQP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((GQP,), dtype=tl.float32)
        acc_c = tl.zeros((GQP, RC), dtype=tl.float32)
        kc = kc_ptr + b64 * c_sb + h * c_sh
        vc = vc_ptr + b64 * c_sb + h * c_sh
        ks = ks_ptr + b64 * s_sb + h * s_sh
        vs = vs_ptr + b64 * s_sb + h * s_sh
        for t0 in range(lo, hi, BLOCK_T):
            tok = t0 + t
            inside = tok < hi
            ok = inside & (tok >= first_valid)
            ck = _codes(kc, tok, inside, c_st, R, RC)  # [T, RC] float16
            if ONE_SCALE:
                k_scale = tl.load(ks + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                s = tl.dot(qp, tl.trans(ck)) * k_scale[None, :]  # [GQP, T], float32 sums
            else:
                s = tl.dot(qp, tl.trans(ck * _block_scales(ks, tok, inside, s_st, R, RC, RB)))
            if RANK0 > 0:
                s += tl.dot(qr0, tl.trans(_level_values(k0_pk, k0_sc, k0_ts, k0_tm, bh, tiles, tok, inside, RANK0, GROUP0, RP, BLOCK_T)))
            if RANK1 > 0:
                s += tl.dot(qr1, tl.trans(_level_values(k1_pk, k1_sc, k1_ts, k1_tm, bh, tiles, tok, inside, RANK1, GROUP1, RP, BLOCK_T)))
            if RANK2 > 0:
                s += tl.dot(qr2, tl.trans(_level_values(k2_pk, k2_sc, k2_ts, k2_tm, bh, tiles, tok, inside, RANK2, GROUP2, RP, BLOCK_T)))
            s = tl.where(ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)  # [GQP, T]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            p16 = p.to(tl.float16)
            cv = _codes(vc, tok, inside, c_st, R, RC)
            if ONE_SCALE:
                v_scale = tl.load(vs + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                acc_c = acc_c * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(tl.float16), cv)
            else:
                acc_c = acc_c * alpha[:, None] + tl.dot(p16, cv * _block_scales(vs, tok, inside, s_st, R, RC, RB))
            if RANK0 > 0:
                acc_r0 = acc_r0 * alpha[:, None] + tl.dot(p16, _level_values(v0_pk, v0_sc, v0_ts, v0_tm, bh, tiles, tok, inside, RANK0, GROUP0, RP, BLOCK_T))
            if RANK1 > 0:
                acc_r1 = acc_r1 * alpha[:, None] + tl.dot(p16, _level_values(v1_pk, v1_sc, v1_ts, v1_tm, bh, tiles, tok, inside, RANK1, GROUP1, RP, BLOCK_T))
            if RANK2 > 0:
                acc_r2 = acc_r2 * alpha[:, None] + tl.dot(p16, _level_values(v2_pk, v2_sc, v2_ts, v2_tm, bh, tiles, tok, inside, RANK2, GROUP2, RP, BLOCK_T))

        # back to head_dim: (sum p c) P_v + per level (sum p g e) R, 32 columns at a time
        vb = vb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        vrb = vrb_ptr + b64 * rb_sb + h * rb_sh
        acc_c16 = acc_c.to(tl.float16)
        acc_r0 = (acc_r0 * v_gate).to(tl.float16)
        acc_r1 = (acc_r1 * v_gate).to(tl.float16)
        acc_r2 = (acc_r2 * v_gate).to(tl.float16)
        slot = (bh * GQ + g) * partials + seg
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, l_i, mask=g_ok)
        for d0 in tl.static_range(0, D, 32):
            dc = d0 + tl.arange(0, 32)
            out = tl.dot(acc_c16, _rows(vb + d0, b_sr, R, RC, 32).to(tl.float16))  # [GQP, 32]
            if RANK0 > 0:
                out += tl.dot(acc_r0, _level_rows(vrb + d0, rb_sr, RANK0, RP, 32).to(tl.float16))
            if RANK1 > 0:
                out += tl.dot(acc_r1, _level_rows(vrb + d0, rb_sr, RANK1, RP, 32).to(tl.float16))
            if RANK2 > 0:
                out += tl.dot(acc_r2, _level_rows(vrb + d0, rb_sr, RANK2, RP, 32).to(tl.float16))
            tl.store(acc_ptr + slot[:, None] * D + dc[None, :], out, mask=g_ok[:, None])

    # The exact-window pass: one program per batch row x KV head, grid (B * H,). ek_ptr / ev_ptr the
    # window's keys and values [B, H, W, D] (model dtype, one layout: e_s* strides, contiguous along D),
    # window = W, offset = T (the window's first logical position); it writes the partial slot_index of
    # each query head, as the packed-token pass writes its segments'. HAS_FILL: the window is kept for a CUDA
    # graph, W rows of buffer of which the first fill + 1 (fill: int32 at fill_ptr) are attended. PDL: it runs before
    # the packed-token pass, which is launched as its programmatic dependent (kvweave.kernels.launch.PROGRAMMATIC_EXACT).
    @triton.jit
    def _exact_split_kernel(
        q_ptr, start_ptr, ek_ptr, ev_ptr, e_sb, e_sh, e_st, window, offset,
        m_ptr, l_ptr, acc_ptr, partials, slot_index, H, qk_scale, fill_ptr,
        GQ: tl.constexpr, GQP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, HAS_FILL: tl.constexpr,
        PDL: tl.constexpr = False,
    ):
        if PDL:  # the packed-token pass, launched after this one as its programmatic dependent, may start at once
            gdc_launch_dependents()
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        g = tl.arange(0, GQP)
        d = tl.arange(0, D)
        w = tl.arange(0, BLOCK)
        g_ok = g < GQ
        first_valid = tl.load(start_ptr + b)
        if HAS_FILL:
            window = tl.minimum(window, tl.load(fill_ptr) + 1)
        q = tl.load(q_ptr + (bh * GQ + g)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale
        m_i = tl.full((GQP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((GQP,), dtype=tl.float32)
        acc = tl.zeros((GQP, D), dtype=tl.float32)
        base = b.to(tl.int64) * e_sb + h * e_sh
        for w0 in range(0, window, BLOCK):
            idx = w0 + w
            inside = idx < window
            ok = inside & (offset + idx >= first_valid)
            keys = tl.load(ek_ptr + base + idx[:, None] * e_st + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision="tf32x3")  # [GQP, BLOCK]
            s = tl.where(ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            vals = tl.load(ev_ptr + base + idx[:, None] * e_st + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="tf32x3")
        slot = (bh * GQ + g) * partials + slot_index
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, l_i, mask=g_ok)
        tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=g_ok[:, None])

    # The combine pass: one program per (batch row, query head), grid (B * Hq,): merges its `partials`
    # (max, sum, output) slots, CHUNK at a time, into out_ptr [B, Hq, D] (zeros where nothing is attended).
    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, partials, D: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        d = tl.arange(0, D)
        top = tl.full((CHUNK,), -1.0e30, dtype=tl.float32)
        for c0 in range(0, partials, CHUNK):
            top = tl.maximum(top, tl.load(m_ptr + row * partials + c0 + c, mask=c0 + c < partials, other=-1.0e30))
        big = tl.max(top, axis=0)
        total = tl.zeros((CHUNK,), dtype=tl.float32)
        acc = tl.zeros((D,), dtype=tl.float32)
        for c0 in range(0, partials, CHUNK):
            inside = c0 + c < partials
            m = tl.load(m_ptr + row * partials + c0 + c, mask=inside, other=-1.0e30)
            weight = tl.where(inside, tl.exp2(m - big), 0.0)
            total += weight * tl.load(l_ptr + row * partials + c0 + c, mask=inside, other=0.0)
            part = tl.load(acc_ptr + (row * partials + c0 + c)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            acc += tl.sum(weight[:, None] * part, axis=0)
        denominator = tl.sum(total, axis=0)
        result = tl.where(denominator > 0, acc / tl.where(denominator > 0, denominator, 1.0), 0.0)
        tl.store(out_ptr + row * D + d, result.to(out_ptr.dtype.element_ty))

    # The one-pass combine: grid (B * Hq, D // DC); each program merges the `partials` slots of one query head for DC
    # of its D output columns, CHUNK slots a step with a running maximum (one read of each slot's max, sum and
    # columns); with CHUNK >= partials a single step, whose loads do not wait on each other.
    @triton.jit
    def _combine_columns_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, partials, D: tl.constexpr, DC: tl.constexpr,
                                CHUNK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        d = tl.program_id(1) * DC + tl.arange(0, DC)
        big = tl.max(tl.full((CHUNK,), -1.0e30, dtype=tl.float32), axis=0)
        total = tl.sum(tl.zeros((CHUNK,), dtype=tl.float32), axis=0)
        acc = tl.zeros((DC,), dtype=tl.float32)
        for c0 in range(0, partials, CHUNK):
            slot = row * partials + c0 + c
            inside = c0 + c < partials
            m = tl.load(m_ptr + slot, mask=inside, other=-1.0e30)
            sums = tl.load(l_ptr + slot, mask=inside, other=0.0)
            part = tl.load(acc_ptr + slot[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            top = tl.maximum(big, tl.max(m, axis=0))
            rescale = tl.exp2(big - top)
            weight = tl.where(inside, tl.exp2(m - top), 0.0)
            total = total * rescale + tl.sum(weight * sums, axis=0)
            acc = acc * rescale + tl.sum(weight[:, None] * part, axis=0)
            big = top
        result = tl.where(total > 0, acc / tl.where(total > 0, total, 1.0), 0.0)
        tl.store(out_ptr + row * D + d, result.to(out_ptr.dtype.element_ty))
