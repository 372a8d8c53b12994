"""What a step of the ``dense`` kernel (:mod:`kvweave.kernels.lowbit_dense_triton`) reads besides its codes, loaded a
step ahead (:func:`_step_loads`), and its 4-bit keys' logits as eight products, one per code place of a word
(:func:`_plane_fold`, :func:`_plane_dots`). Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_codes_triton import _plus128

    @triton.jit
    def _half(words, k: tl.constexpr):
        """The float16 number in half ``k % 2`` of each int32 word (two float16 numbers a word, little-endian), as
        float32."""
        return ((words >> (16 * (k % 2))) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _row(rows, k: tl.constexpr, scaling):
        """Code place ``k``'s query entries at ``rows`` (the model's dtype) as float32, times ``scaling``."""
        return tl.load(rows + k).to(tl.float32) * scaling

    @triton.jit
    def _plane_queries(q_row, scaling, jk, gi, D: tl.constexpr):
        """The query rows [KW, G] of each code place ``k`` (channels ``j * 8 + k``), times ``scaling``: loaded once
        before a program's steps (left in the loop, a build whose loop holds an instruction the compiler may not move
        loads past copied them into shared memory every step)."""
        rows = q_row + gi[None, :] * D + (jk * 8)[:, None]  # code place 0's channels; place k is k further
        return (_row(rows, 0, scaling), _row(rows, 1, scaling), _row(rows, 2, scaling), _row(rows, 3, scaling),
                _row(rows, 4, scaling), _row(rows, 5, scaling), _row(rows, 6, scaling), _row(rows, 7, scaling))

    @triton.jit
    def _plane_query(qk, ks_ptr, kz_ptr, meta, kw, zw, jk, k: tl.constexpr, LOWP: tl.constexpr, KPF: tl.constexpr):
        """Code place ``k``'s scaled query rows [KW, G] (its query rows ``qk``, :func:`_plane_queries`, times the
        channels' scales; bfloat16 with ``LOWP``) and what its zero points and the operands' offset of 128 add to the
        logits, per row. ``KPF``: its scales and zero points come loaded a step ahead as the int32 words ``kw``, ``zw``
        [KW] that hold them with the next channel's; else they are loaded here."""
        chan = jk * 8 + k  # [KW]: the channels of code place k
        if KPF:
            qs = qk * _half(kw, k)[:, None]
            zero = _half(zw, k)
        else:
            qs = qk * tl.load(ks_ptr + meta + chan).to(tl.float32)[:, None]
            zero = tl.load(kz_ptr + meta + chan).to(tl.float32)
        if LOWP:  # the operand is 128 + code: 128 times the scaled query's sum taken off, in the same sum
            qs = qs.to(tl.bfloat16)
        return qs, zero

    @triton.jit
    def _bias_add(total, qk, zero, qs, LOWP: tl.constexpr):
        """``total`` plus what code place ``k``'s zero points (``zero`` [KW]) add to the logits per tile entry, and with
        ``LOWP`` less 128 times its rounded scaled query ``qs``: fused multiply-adds, the sum over code places carried
        in them."""
        total = tl.fma(qk, zero[:, None], total)
        if LOWP:
            total = tl.fma(qs.to(tl.float32), -128.0, total)
        return total

    def _plane_text(k: int) -> str:
        """Code place ``k``'s operand register from two words (the columns ``2 c``, ``2 c + 1`` of a token): their low
        (``k`` < 4) or high halves side by side in one byte permute, shifted to nibble 0, masked and under the bits of
        bfloat16 128 in one three-input logic operation (``(t & 0x000F000F) | 0x43004300``): three instructions where
        the codes one at a time took five (and the byte permutes are the same for four code places)."""
        return ("{ .reg .b32 t; prmt.b32 t, $1, $2, %d; shr.b32 t, t, %d; lop3.b32 $0, t, 0x000F000F, 0x43004300, 0xEA; }"
                % (0x5410 if k < 4 else 0x7632, 4 * (k % 4)))

    _PLANE_TEXTS = tl.constexpr(tuple(_plane_text(k) for k in range(8)))

    @triton.jit
    def _plane_operand(words, k: tl.constexpr):
        """Code place ``k`` of ``words`` [BLOCK, KW] as bfloat16 ``128 + code`` in pairs of registers (on a GPU)."""
        text: tl.constexpr = _PLANE_TEXTS[k]
        return tl.inline_asm_elementwise(text, "=r,r,r", [words], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _plane_dot(words, qs, s, k: tl.constexpr, LOWP: tl.constexpr, ASM: tl.constexpr):
        """``s`` plus code place ``k`` of ``words`` times its scaled query rows."""
        if ASM:
            s = tl.dot(_plane_operand(words, k), qs, s)
        elif LOWP:
            s = tl.dot(_plus128((words >> (4 * k)) & 0xF), qs, s)
        else:
            s = tl.dot(((words >> (4 * k)) & 0xF).to(tl.float32), qs, s, input_precision="ieee")
        return s

    @triton.jit
    def _plane_fold(q0, q1, q2, q3, q4, q5, q6, q7, ks_ptr, kz_ptr, meta, kw0, kw1, kw2, kw3, zw0, zw1, zw2, zw3, jk,
                    LOWP: tl.constexpr, KPF: tl.constexpr):
        """A key group's scales folded into the eight code places' query rows (:func:`_plane_query`) and its zero
        points into one bias a query column [G] (:func:`_bias_add`): what every step of the group shares. ``kw0 ..
        kw3``, ``zw0 .. zw3``: the scales and zero points of code places ``2 c, 2 c + 1`` (``KPF``)."""
        qs0, z0 = _plane_query(q0, ks_ptr, kz_ptr, meta, kw0, zw0, jk, 0, LOWP, KPF)
        qs1, z1 = _plane_query(q1, ks_ptr, kz_ptr, meta, kw0, zw0, jk, 1, LOWP, KPF)
        qs2, z2 = _plane_query(q2, ks_ptr, kz_ptr, meta, kw1, zw1, jk, 2, LOWP, KPF)
        qs3, z3 = _plane_query(q3, ks_ptr, kz_ptr, meta, kw1, zw1, jk, 3, LOWP, KPF)
        qs4, z4 = _plane_query(q4, ks_ptr, kz_ptr, meta, kw2, zw2, jk, 4, LOWP, KPF)
        qs5, z5 = _plane_query(q5, ks_ptr, kz_ptr, meta, kw2, zw2, jk, 5, LOWP, KPF)
        qs6, z6 = _plane_query(q6, ks_ptr, kz_ptr, meta, kw3, zw3, jk, 6, LOWP, KPF)
        qs7, z7 = _plane_query(q7, ks_ptr, kz_ptr, meta, kw3, zw3, jk, 7, LOWP, KPF)
        total = _bias_add(tl.zeros_like(q0), q0, z0, qs0, LOWP)
        total = _bias_add(total, q1, z1, qs1, LOWP)
        total = _bias_add(total, q2, z2, qs2, LOWP)
        total = _bias_add(total, q3, z3, qs3, LOWP)
        total = _bias_add(total, q4, z4, qs4, LOWP)
        total = _bias_add(total, q5, z5, qs5, LOWP)
        total = _bias_add(total, q6, z6, qs6, LOWP)
        total = _bias_add(total, q7, z7, qs7, LOWP)
        return qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, tl.sum(total, 0)

    @triton.jit
    def _plane_dots(words, qs0, qs1, qs2, qs3, qs4, qs5, qs6, qs7, bias, LOWP: tl.constexpr, ASM: tl.constexpr):
        """The logits [BLOCK, G] of a step's 4-bit keys (``words`` [BLOCK, KW] uint32) from its group's fold
        (:func:`_plane_fold`) in eight products, one per code place ``k`` of a word: its operand is the words' code
        ``k`` as they are (channel ``j * 8 + k`` in column ``j``), met by the scaled query's rows of those channels. Each
        product's operand is made from the words element by element, so Triton reads the words from shared memory
        straight into the tensor cores' operand layout: no unpacked tile goes through shared memory (the store and
        reload of the [BLOCK, D] tile was the largest share of the kernel's shared-memory traffic)."""
        s = tl.zeros([words.shape[0], qs0.shape[1]], tl.float32) + bias[None, :]
        s = _plane_dot(words, qs0, s, 0, LOWP, ASM)
        s = _plane_dot(words, qs1, s, 1, LOWP, ASM)
        s = _plane_dot(words, qs2, s, 2, LOWP, ASM)
        s = _plane_dot(words, qs3, s, 3, LOWP, ASM)
        s = _plane_dot(words, qs4, s, 4, LOWP, ASM)
        s = _plane_dot(words, qs5, s, 5, LOWP, ASM)
        s = _plane_dot(words, qs6, s, 6, LOWP, ASM)
        s = _plane_dot(words, qs7, s, 7, LOWP, ASM)
        return s

    @triton.jit
    def _over(index, N: tl.constexpr):
        """``index // N`` for a token index that is never negative: an unsigned division (a shift where ``N`` is a power
        of two, where the signed one takes three instructions to round toward zero)."""
        return (tl.cast(index, tl.uint32) // N).to(tl.int32)

    @triton.jit
    def _scale_loads(vs_row, vmax_row, t_idx, g: tl.constexpr, VGROUPS: tl.constexpr, VLOG: tl.constexpr,
                     VST: tl.constexpr):
        """Value group ``g``'s stored scales of tokens ``t_idx`` and, for log8 scales, their spans' maxima, as loaded
        (:func:`_scale_of` makes the scales; the loads are a step ahead of their use)."""
        stored = tl.load(vs_row + t_idx * VGROUPS + g)
        top = stored
        if VLOG:
            top = tl.load(vmax_row + _over(t_idx, VST) * VGROUPS + g)
        return stored, top

    @triton.jit
    def _exp2(x, ASM: tl.constexpr):
        """``2 ** x``; on a GPU the special function unit's approximation alone (results below float32's normal range
        flushed to 0: no range reduction around it, 3 instructions fewer an element)."""
        if ASM:
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                             pack=1)
        return tl.exp2(x)

    @triton.jit
    def _softmax_step(s, m_i, l_i, top, first, ASM: tl.constexpr, FIX: tl.constexpr):
        """A step's probabilities from its logits ``s`` [BLOCK, R] (base 2, -inf where hidden), what rescales the
        running sums before them (``alpha`` [R]), the per-slot sums ``l_i`` and the reference ``m_i`` [R] after them.
        Online (not ``FIX``): the running maximum, a reduction across the warps each step. ``FIX``: a fixed reference,
        the largest logit of the program's first step (``first``: this is it) and each slot's largest logit kept in
        ``top`` for the caller, who runs the program again against the largest seen where it rose too far."""
        if FIX:
            if first:
                m_i = tl.max(s, 0)
            m_safe = tl.where(m_i == float("-inf"), 0.0, m_i)
            p = _exp2(s - m_safe[None, :], ASM)
            top = tl.maximum(top, s)
            alpha = tl.full(m_i.shape, 1.0, tl.float32)
            l_i = l_i + p
        else:
            m_new = tl.maximum(m_i, tl.max(s, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = _exp2(s - m_safe[None, :], ASM)  # logits in base 2: the query carries log2(e)
            alpha = _exp2(m_i - m_safe, ASM)
            l_i = l_i * alpha[None, :] + p  # per slot, summed once after the loop: a sum over the step's tokens
            m_i = m_new
        return p, alpha, l_i, m_i, top

    @triton.jit
    def _scale_of(stored, top, VLOG: tl.constexpr, ASM: tl.constexpr):
        """The scales of :func:`_scale_loads`' loads (``_value_scale``'s arithmetic)."""
        if VLOG:
            return top.to(tl.float32) * _exp2(stored.to(tl.float32) * -0.0625, ASM)
        return stored.to(tl.float32)

    @triton.jit
    def _step_loads(t0, ch, jk, t_loc, ks_ptr, kz_ptr, vs_row, vmax_row, pos_ptr, D: tl.constexpr,
                    KGROUP: tl.constexpr, VGROUPS: tl.constexpr, VLOG: tl.constexpr, VST: tl.constexpr,
                    HAS_POS: tl.constexpr, KPLANES: tl.constexpr, KPF: tl.constexpr):
        """What a step reads besides its codes, as loaded: the key group's scales and zero points (not with
        ``KPLANES``: :func:`_plane_fold` reads them), each value group's scales (groups past ``VGROUPS`` repeat the
        first), the slots' positions (``HAS_POS``; else zeros); ``KPF``: the scales and zero points of each two code
        places as int32 words (:func:`_plane_query`), else zeros."""
        meta = _over(t0, KGROUP) * D  # a step lies within one token group
        kw0 = tl.zeros_like(jk)
        kw1, kw2, kw3, zw0, zw1, zw2, zw3 = kw0, kw0, kw0, kw0, kw0, kw0, kw0
        if KPF:  # float16 pairs read as int32 words: channel j * 8 + k is half k % 2 of word j * 4 + k // 2; a row's
            # four words in one vector load (two a step where they were eight)
            four = tl.arange(0, 4)
            ksw = ks_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + meta // 2 + jk[:, None] * 4 + four[None, :]
            kzw = kz_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + meta // 2 + jk[:, None] * 4 + four[None, :]
            a, b = tl.split(tl.load(ksw).reshape(jk.shape[0], 2, 2))
            kw0, kw2 = tl.split(a)
            kw1, kw3 = tl.split(b)
            a, b = tl.split(tl.load(kzw).reshape(jk.shape[0], 2, 2))
            zw0, zw2 = tl.split(a)
            zw1, zw3 = tl.split(b)
        if KPLANES:
            ks = tl.zeros_like(ch)
            kz = ks
        else:
            ks = tl.load(ks_ptr + meta + ch)
            kz = tl.load(kz_ptr + meta + ch)
        t_idx = t0 + t_loc
        s0, m0 = _scale_loads(vs_row, vmax_row, t_idx, 0, VGROUPS, VLOG, VST)
        s1, m1 = s0, m0
        s2, m2 = s0, m0
        s3, m3 = s0, m0
        if VGROUPS > 1:
            s1, m1 = _scale_loads(vs_row, vmax_row, t_idx, 1, VGROUPS, VLOG, VST)
        if VGROUPS > 2:
            s2, m2 = _scale_loads(vs_row, vmax_row, t_idx, 2, VGROUPS, VLOG, VST)
            s3, m3 = _scale_loads(vs_row, vmax_row, t_idx, 3, VGROUPS, VLOG, VST)
        pos = tl.zeros_like(t_loc)
        if HAS_POS:
            pos = tl.load(pos_ptr + t_idx).to(tl.int32)
        return ks, kz, kw0, kw1, kw2, kw3, zw0, zw1, zw2, zw3, s0, m0, s1, m1, s2, m2, s3, m3, pos
