"""The ``@triton.jit`` kernels that combine the splits of the ``lowbit`` decode attention's packed pass, rotate their
output back and merge the exact window and the restored tokens (:func:`kvweave.kernels.lowbit_decode.plan_combine`):
one program per query head (``_lowbit_combine_kernel``), or per KV head of a row with its query heads together
(``_lowbit_combine_group_kernel``: ``QR`` rows, those past the group masked), which reads the rotation and the exact
tokens' keys and values once for the group instead of once per query head but makes each program's chain of loads
longer (many rows: 114 against 206 us a layer at B = 130 on the H200; few rows: slower, 36.0 against 24.0 us at B = 1,
32K; docs/kernels.md "Five programs an SM, and splits by waves"). Every product is a float32 multiply and sum over a
broadcast tile (float32 tile products build without tensor cores and spilled). Without triton the module defines no
kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.grid_dependency_triton import gdc_wait
    from kvweave.kernels.timeline_triton import _begin_stamp, _cycles, _end_stamp
    from kvweave.kernels.window_triton import _rounded

    @triton.jit
    def _joined(m1, t1, o1, m2, t2, o2, GROUPED: tl.constexpr):
        """Two running (max, sum, output) states of one attention merged by their log-sum-exp: the exact tokens' and the
        packed pass's. ``GROUPED``: maxima and sums [QR], outputs [QR, D]; else scalars and [D]."""
        m = tl.maximum(m1, m2)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        a1, a2 = tl.exp(m1 - m_safe), tl.exp(m2 - m_safe)
        if GROUPED:
            out = o1 * a1[:, None] + o2 * a2[:, None]
        else:
            out = o1 * a1 + o2 * a2
        return m, a1 * t1 + a2 * t2, out

    @triton.jit
    def _merge_tokens(k_ptr, v_ptr, slot, ok, chan, vchan, q, m, total, out, D: tl.constexpr, GROUPED: tl.constexpr):
        """Tokens ``slot`` [EB] (rows of [.., D] keys and values; ``ok``: attended) merged into a running max, sum and
        output by their exact attention (``q`` already scaled): the new (max, sum, output). ``GROUPED``: ``q`` is [QR, D]
        query rows with max and sum [QR] and output [QR, D]; else one row, [D] and scalars, the output's channels
        ``vchan`` (all ``chan``, or a slice of them)."""
        keys = tl.load(k_ptr + slot[:, None] * D + chan[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        if GROUPED:
            logits = tl.where(ok[:, None], tl.sum(keys[:, None, :] * q[None, :, :], 2), float("-inf"))  # [EB, QR]
        else:
            logits = tl.where(ok, tl.sum(keys * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m, tl.max(logits, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        if GROUPED:
            p = tl.exp(logits - m_safe[None, :])
        else:
            p = tl.exp(logits - m_safe)
        values = tl.load(v_ptr + slot[:, None] * D + vchan[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        total = total * alpha + tl.sum(p, 0)
        if GROUPED:
            out = out * alpha[:, None] + tl.sum(p[:, :, None] * values[:, None, :], 0)
        else:
            out = out * alpha + tl.sum(p[:, None] * values, 0)
        return m_new, total, out

    @triton.jit
    def _exact_tokens(m, total, out, q, chan, vchan, bh, batch, start_ptr, rk_ptr, rv_ptr, rpos_ptr, ek_ptr, ev_ptr,
                      fill_ptr, restored, exact, exact_first, D: tl.constexpr, HAS_START: tl.constexpr, HAS_REST: tl.constexpr,
                      HAS_FILL: tl.constexpr, EB: tl.constexpr, GROUPED: tl.constexpr):
        """The restored tokens, then the exact window, merged into the running max, sum and output (the same online
        merge, :func:`_merge_tokens`)."""
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        e_idx = tl.arange(0, EB)
        if HAS_REST:
            for j0 in range(0, restored, EB):
                j = j0 + e_idx
                pos = tl.load(rpos_ptr + bh * restored + j, mask=j < restored, other=-1)
                ok = (j < restored) & (pos >= 0) & (pos >= start)
                m, total, out = _merge_tokens(rk_ptr, rv_ptr, bh * restored + j, ok, chan, vchan, q, m, total, out, D,
                                              GROUPED)
        held = exact
        if HAS_FILL:
            held = tl.load(fill_ptr) + 1
        for j0 in range(0, held, EB):
            j = j0 + e_idx
            ok = (j < held) & (exact_first + j >= start)
            m, total, out = _merge_tokens(ek_ptr, ev_ptr, bh * exact + j, ok, chan, vchan, q, m, total, out, D, GROUPED)
        return m, total, out

    @triton.jit
    def _hadamard(x, R: tl.constexpr, D: tl.constexpr, STAGES: tl.constexpr):
        """Each row of ``x`` [R, D] times the Sylvester Hadamard matrix H_D (D = 2 ** ``STAGES``): a butterfly on the
        channel index's lowest bit per stage, after which that bit becomes the highest, so ``STAGES`` stages take each
        bit once and leave the order as it was."""
        for _ in tl.static_range(STAGES):
            a, b = tl.split(tl.reshape(x, (R, D // 2, 2)))
            x = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), (R, D))
        return x

    @triton.jit
    def _hadamard_row(x, D: tl.constexpr, STAGES: tl.constexpr):
        """:func:`_hadamard` of one row ``x`` [D]."""
        return tl.reshape(_hadamard(tl.reshape(x, (1, D)), 1, D, STAGES), (D,))

    @triton.jit
    def _splits_merged(m_ptr, l_ptr, acc_ptr, rot_ptr, rot, bh, g, splits, ochan, D: tl.constexpr, G: tl.constexpr,
                       SB: tl.constexpr, CB: tl.constexpr, WHOLE: tl.constexpr, DS: tl.constexpr, HAD: tl.constexpr):
        """Query row ``g`` of row ``bh``: the running max, sum and output channels ``ochan`` [DS] (rotated back by
        ``rot``; ``DS``: all ``D`` or a slice) of the packed pass's splits. ``WHOLE``: every split in one tile of
        ``SB``, and the rotation's columns ``rot`` [D, DS] loaded by the caller (:func:`_whole_rotation`), so the loads
        have no loop between them and go out together (at one batch row the chunked loops' chain of loads took 7 of
        the 24 us of a layer call at 32K on the H200); else ``SB`` splits and ``CB`` rotation rows at a time from
        ``rot_ptr``. With ``HAD`` > 0 (a Hadamard rotation, ``DS`` = ``D``; ``CB`` = ``D`` where not ``WHOLE``) the
        merged output is rotated by :func:`_hadamard` in ``HAD`` stages and the rotation's first row (``rot``, or read
        here)."""
        s_idx = tl.arange(0, SB)
        c_idx = tl.arange(0, CB)
        out = tl.zeros([DS], tl.float32)
        if WHOLE:
            ok = s_idx < splits
            at = (bh * splits + s_idx) * G + g
            tops = tl.load(m_ptr + at, mask=ok, other=float("-inf"))
            sums = tl.load(l_ptr + at, mask=ok, other=0.0)
            acc = tl.load(acc_ptr + at[:, None] * D + c_idx[None, :], mask=ok[:, None], other=0.0)
            m = tl.max(tops, 0)
            w = tl.exp(tops - tl.where(m == float("-inf"), 0.0, m))
            total = tl.sum(w * sums, 0)
            merged = tl.sum(w[:, None] * acc, 0)
            if HAD > 0:
                out += _hadamard_row(merged, D, HAD) * rot
            else:
                out += tl.sum(merged[:, None] * rot, 0)
        else:
            top = tl.full([SB], float("-inf"), tl.float32)
            for s0 in range(0, splits, SB):  # the largest running max of any split
                ok = s0 + s_idx < splits
                top = tl.maximum(top, tl.load(m_ptr + (bh * splits + s0 + s_idx) * G + g, mask=ok, other=float("-inf")))
            m = tl.max(top, 0)
            m_safe = tl.where(m == float("-inf"), 0.0, m)
            total = tl.sum(tl.zeros([SB], tl.float32), 0)
            for c0 in tl.static_range(0, D, CB):  # the splits' outputs summed, chunk of rotated channels by chunk
                part = tl.zeros([CB], tl.float32)
                for s0 in range(0, splits, SB):
                    ok = s0 + s_idx < splits
                    at = (bh * splits + s0 + s_idx) * G + g
                    w = tl.exp(tl.load(m_ptr + at, mask=ok, other=float("-inf")) - m_safe)
                    if c0 == 0:
                        total += tl.sum(w * tl.load(l_ptr + at, mask=ok, other=0.0), 0)
                    a = tl.load(acc_ptr + at[:, None] * D + c0 + c_idx[None, :], mask=ok[:, None], other=0.0)
                    part += tl.sum(w[:, None] * a, 0)
                if HAD > 0:  # one chunk of every channel (CB = D = DS): the transform and the first row
                    out += _hadamard_row(part, D, HAD) * tl.load(rot_ptr + ochan)
                else:
                    rot = tl.load(rot_ptr + (c0 + c_idx)[:, None] * D + ochan[None, :])  # rows c0 .. of the rotation
                    out += tl.sum(part[:, None] * rot, 0)
        return m, total, out

    @triton.jit
    def _whole_rotation(rot_ptr, chan, ochan, D: tl.constexpr, WHOLE: tl.constexpr, HAD: tl.constexpr):
        """The rotation's columns ``ochan`` [D, DS] in one tile where :func:`_splits_merged` reads it whole
        (``WHOLE``; a Hadamard rotation's first row [D] with ``HAD``), else 0."""
        rot = 0.0
        if WHOLE and HAD > 0:
            rot = tl.load(rot_ptr + ochan)
        elif WHOLE:
            rot = tl.load(rot_ptr + chan[:, None] * D + ochan[None, :])
        return rot

    @triton.jit
    def _lowbit_combine_kernel(
        m_ptr, l_ptr, acc_ptr, rot_ptr, q_ptr, ek_ptr, ev_ptr, rk_ptr, rv_ptr, rpos_ptr, start_ptr, fill_ptr, out_ptr,
        splits, exact, restored, exact_first, scaling, trace_ptr,
        D: tl.constexpr, G: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, HAS_START: tl.constexpr,
        HAS_REST: tl.constexpr, HAS_FILL: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr, EB: tl.constexpr,
        WHOLE: tl.constexpr, PDL: tl.constexpr, SLICES: tl.constexpr, HAD: tl.constexpr = 0, TRACE: tl.constexpr = 0,
    ):
        """One query head of one row (with ``SLICES`` > 1, one of its ``SLICES`` slices of output channels: the
        splits' and exact tokens' weights computed in each slice's program, only its channels' values, outputs and
        rotation columns read): the splits of the packed pass combined (``m``, ``l``, ``acc`` [BH, S, G(, D)]),
        their output rotated back once (``rot`` [D, D]; with ``HAD`` > 0 a Hadamard one, by a transform of ``HAD``
        stages), then the exact window [B, H, n, D] (positions ``exact_first
        ..``) and the tokens full-rank residuals restore ([B, H, r, D], positions ``rpos``, -1: none) attended
        exactly and merged by their log-sum-exp: ``out`` [B, Hq, D] float32 (what ``_merge_exact`` computes). ``HAS_FILL``:
        the window rows are buffers of ``exact`` tokens, of which the first ``fill + 1`` (``fill_ptr``, int32 [1]) are
        attended (a window kept for a CUDA graph). The exact and restored tokens and the rotation come first, the splits
        last: with ``PDL`` the kernel is launched as a programmatic dependent of the packed pass and waits for that pass
        only before it reads the splits. ``TRACE``: each program's start, end, SM and the moment past its wait written
        to ``trace_ptr`` (:mod:`kvweave.kernels.timeline`; a placeholder otherwise)."""
        if TRACE:
            begin_ns, begin_cycles = _begin_stamp()
        DS: tl.constexpr = D // SLICES  # the output channels a program writes
        row = tl.program_id(0) // SLICES  # batch * query heads
        ochan = tl.program_id(0) % SLICES * DS + tl.arange(0, DS)
        batch = row // (HEADS * GROUP)
        head = (row // GROUP) % HEADS
        g = row % GROUP
        bh = (batch * HEADS + head).to(tl.int64)
        chan = tl.arange(0, D)
        q = tl.load(q_ptr + row.to(tl.int64) * D + chan).to(tl.float32) * scaling
        rot = _whole_rotation(rot_ptr, chan, ochan, D, WHOLE, HAD)
        m_e, total_e, out_e = _exact_tokens(tl.full([], float("-inf"), tl.float32), tl.zeros([], tl.float32),
                                            tl.zeros([DS], tl.float32), q, chan, ochan, bh, batch, start_ptr,
                                            rk_ptr, rv_ptr, rpos_ptr, ek_ptr, ev_ptr, fill_ptr, restored, exact,
                                            exact_first, D, HAS_START, HAS_REST, HAS_FILL, EB, False)
        if PDL:  # the packed pass's splits are complete and visible past this
            gdc_wait()
        if TRACE:
            ready_cycles = _cycles()
        m, total, out = _splits_merged(m_ptr, l_ptr, acc_ptr, rot_ptr, rot, bh, g, splits, ochan, D, G, SB, CB, WHOLE,
                                       DS, HAD)
        m, total, out = _joined(m, total, out, m_e, total_e, out_e, False)
        tl.store(out_ptr + row.to(tl.int64) * D + ochan, _rounded(out / total, out_ptr.dtype.element_ty))
        if TRACE:
            _end_stamp(trace_ptr, tl.program_id(0), begin_ns, begin_cycles, ready_cycles)

    @triton.jit
    def _lowbit_combine_group_kernel(
        m_ptr, l_ptr, acc_ptr, rot_ptr, q_ptr, ek_ptr, ev_ptr, rk_ptr, rv_ptr, rpos_ptr, start_ptr, fill_ptr, out_ptr,
        splits, exact, restored, exact_first, scaling, trace_ptr,
        D: tl.constexpr, G: tl.constexpr, HEADS: tl.constexpr, GROUP: tl.constexpr, HAS_START: tl.constexpr,
        HAS_REST: tl.constexpr, HAS_FILL: tl.constexpr, SB: tl.constexpr, CB: tl.constexpr, EB: tl.constexpr,
        QR: tl.constexpr, PDL: tl.constexpr, HAD: tl.constexpr = 0, TRACE: tl.constexpr = 0,
    ):
        """The query heads of one KV head of one row: the splits of the packed pass combined (``m``, ``l``, ``acc``
        [BH, S, G(, D)], the heads in rows ``0 .. GROUP``), their output rotated back once (``rot`` [D, D], ``CB`` rows
        at a time), then the exact window [B, H, n, D] (positions ``exact_first ..``) and the tokens full-rank residuals
        restore ([B, H, r, D], positions ``rpos``, -1: none) attended exactly and merged by their log-sum-exp: ``out``
        [B, Hq, D] float32 (what ``_merge_exact`` computes). ``HAS_FILL``: the window rows are buffers of ``exact``
        tokens, of which the first ``fill + 1`` (``fill_ptr``, int32 [1]) are attended (a window kept for a CUDA
        graph). The exact and restored tokens come first, the splits last (with ``PDL`` waited for only there). With
        ``HAD`` > 0 (a Hadamard rotation) the splits' outputs are merged whole, ``SB`` splits at a time, and rotated by
        :func:`_hadamard` and the rotation's first row instead of its rows. ``TRACE``: as the per-query-head
        kernel's."""
        if TRACE:
            begin_ns, begin_cycles = _begin_stamp()
        bh = tl.program_id(0).to(tl.int64)  # batch * KV heads
        batch = bh // HEADS
        gq = tl.arange(0, QR)
        real = gq < GROUP
        chan = tl.arange(0, D)
        rows = batch * HEADS * GROUP + (bh % HEADS) * GROUP + gq  # [QR]: the query heads' rows of q and out
        q = tl.load(q_ptr + rows[:, None] * D + chan[None, :], mask=real[:, None], other=0.0).to(tl.float32) * scaling
        m_e, total_e, out_e = _exact_tokens(tl.full([QR], float("-inf"), tl.float32), tl.zeros([QR], tl.float32),
                                            tl.zeros([QR, D], tl.float32), q, chan, chan, bh, batch, start_ptr, rk_ptr,
                                            rv_ptr, rpos_ptr, ek_ptr, ev_ptr, fill_ptr, restored, exact, exact_first, D,
                                            HAS_START, HAS_REST, HAS_FILL, EB, True)
        if PDL:  # the packed pass's splits are complete and visible past this
            gdc_wait()
        if TRACE:
            ready_cycles = _cycles()
        s_idx = tl.arange(0, SB)
        c_idx = tl.arange(0, CB)
        top = tl.full([SB, QR], float("-inf"), tl.float32)
        for s0 in range(0, splits, SB):  # the largest running max of any split
            ok = ((s0 + s_idx) < splits)[:, None] & real[None, :]
            top = tl.maximum(top, tl.load(m_ptr + (bh * splits + s0 + s_idx)[:, None] * G + gq[None, :], mask=ok,
                                          other=float("-inf")))
        m = tl.max(top, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.zeros([QR], tl.float32)
        for s0 in range(0, splits, SB):  # the splits' sums, weighted
            ok = ((s0 + s_idx) < splits)[:, None] & real[None, :]
            at = (bh * splits + s0 + s_idx)[:, None] * G + gq[None, :]  # [SB, QR]
            w = tl.exp(tl.load(m_ptr + at, mask=ok, other=float("-inf")) - m_safe[None, :])
            total += tl.sum(w * tl.load(l_ptr + at, mask=ok, other=0.0), 0)
        out = tl.zeros([QR, D], tl.float32)
        if HAD > 0:  # the splits' outputs merged whole, then transformed
            for s0 in range(0, splits, SB):
                ok = ((s0 + s_idx) < splits)[:, None] & real[None, :]
                at = (bh * splits + s0 + s_idx)[:, None] * G + gq[None, :]
                w = tl.exp(tl.load(m_ptr + at, mask=ok, other=float("-inf")) - m_safe[None, :])
                a = tl.load(acc_ptr + at[:, :, None] * D + chan[None, None, :], mask=ok[:, :, None], other=0.0)
                out += tl.sum(w[:, :, None] * a, 0)  # [QR, D]
            out = _hadamard(out, QR, D, HAD) * tl.load(rot_ptr + chan)[None, :]
        else:
            for c0 in range(0, D, CB):  # the splits' outputs summed, chunk of rotated channels by chunk
                part = tl.zeros([QR, CB], tl.float32)
                for s0 in range(0, splits, SB):
                    ok = ((s0 + s_idx) < splits)[:, None] & real[None, :]
                    at = (bh * splits + s0 + s_idx)[:, None] * G + gq[None, :]
                    w = tl.exp(tl.load(m_ptr + at, mask=ok, other=float("-inf")) - m_safe[None, :])
                    a = tl.load(acc_ptr + at[:, :, None] * D + c0 + c_idx[None, None, :], mask=ok[:, :, None],
                                other=0.0)
                    part += tl.sum(w[:, :, None] * a, 0)  # [QR, CB]
                rot = tl.load(rot_ptr + (c0 + c_idx)[:, None] * D + chan[None, :])  # rows c0 .. of the rotation
                out += tl.sum(part[:, :, None] * rot[None, :, :], 1)
        m, total, out = _joined(m, total, out, m_e, total_e, out_e, True)
        tl.store(out_ptr + rows[:, None] * D + chan[None, :], _rounded(out / total[:, None], out_ptr.dtype.element_ty),
                 mask=real[:, None])
        if TRACE:
            _end_stamp(trace_ptr, tl.program_id(0), begin_ns, begin_cycles, ready_cycles)
