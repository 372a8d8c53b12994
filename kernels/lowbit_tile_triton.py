"""The ``dense`` kernel's value operand from values stored in tiles of 64 tokens (``rotated-token-tiled.v1``,
:func:`kvweave.kernels.formats.tile_codes`): a value product takes the levels of 64 channels at 64 tokens as its first
operand, and a thread of a Hopper warpgroup holds, of each 16 tokens, the slots ``2 q, 2 q + 1, 2 q + 8, 2 q + 9`` of
two channels ``8`` apart, which in the tiled order are the codes of one 32-bit word a channel (word ``q``; two words,
``q`` and ``4 + q``, with 4-bit codes). So the operand is made from the words a thread loads, element by element, and never goes through shared memory (token-major
words made the unpacked [64, 64] tile go there and back every step: half of the kernel's shared-memory traffic,
docs/kernels.md). Each word is loaded by the thread that unpacks it: the tile's rows are loaded as two halves of 32
rows (channels whose bit 3 is 0, then 1), one word a thread a load, a layout Triton carries to the product unchanged.
Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_dense import LEVEL_SELECT_ADD, LEVEL_SELECT_MUL, UNIFORM4_BASE, UNIFORM4_OFFSET

    _SEL_MUL = tl.constexpr(LEVEL_SELECT_MUL)
    _SEL_ADD = tl.constexpr(LEVEL_SELECT_ADD * 0x01010101)  # a byte each
    _U4_MASK = tl.constexpr(0x78 * 0x10001)  # a 4-bit code at bit 3 of each half
    _U4_BASE = tl.constexpr(UNIFORM4_BASE * 0x10001)
    _U4_ASM = tl.constexpr("{ .reg .b32 o, c; mov.b32 o, 0x3F803F80; mov.b32 c, 0x%08X; fma.rn.bf16x2 $0, $1, o, c; }"
                           % (UNIFORM4_OFFSET * 0x10001))  # each half times 1.0 plus the offset, rounded to nearest

    @triton.jit
    def _code(words, s: tl.constexpr, h: tl.constexpr, e: tl.constexpr):
        """The code of slot ``16 s + 8 h + 2 q + e`` in word ``q``: bits ``2 (8 h + 4 e + s)``."""
        return ((words >> (2 * s + 16 * h + 8 * e)) & 3).to(tl.int32)

    @triton.jit
    def _codes2(words, h: tl.constexpr, e: tl.constexpr):
        """[R, 4, b, a]: the 2-bit codes of slots ``16 (2 a + b) + 8 h + 2 q + e`` of words ``q`` [R, 4]."""
        return tl.join(tl.join(_code(words, 0, h, e), _code(words, 1, h, e)), tl.join(_code(words, 2, h, e), _code(words, 3, h, e)))

    @triton.jit
    def _half_levels(words, lut, vlev_ptr, vlev16_ptr, LOWP: tl.constexpr, ASM: tl.constexpr):
        """uint32 words [R, 4] (word ``q`` of R channels) -> their 2-bit levels [R, 64], column ``t`` the tile's slot ``t``
        (bfloat16 with ``LOWP``, else float32). On a GPU a byte permute is the table (as for token-major words,
        :func:`kvweave.kernels.lowbit_rows_triton._lut_tiles`): the bytes ``2 s`` of each 16-bit half of a word give
        the selectors of the levels of slots ``e = 0, 1`` at once, one register of the operand."""
        R: tl.constexpr = words.shape[0]
        if ASM:
            z0 = (words & 0x03030303) * _SEL_MUL + _SEL_ADD  # a byte per code: s = 0, at h, e = bytes 2 h + e
            z1 = ((words >> 2) & 0x03030303) * _SEL_MUL + _SEL_ADD
            z2 = ((words >> 4) & 0x03030303) * _SEL_MUL + _SEL_ADD
            z3 = ((words >> 6) & 0x03030303) * _SEL_MUL + _SEL_ADD
            low = tl.join(tl.join(z0, z1), tl.join(z2, z3))  # [R, 4, b, a]: s = 2 a + b
            sel = tl.join(low, low >> 16)  # [R, 4, b, a, h]
            word = lut.to(tl.int64)  # an argument that fits 32 bits comes as int32
            lo = tl.zeros_like(sel) + (word & 0xFFFFFFFF).to(tl.uint32)
            hi = tl.zeros_like(sel) + ((word >> 32) & 0xFFFFFFFF).to(tl.uint32)
            levels = tl.inline_asm_elementwise("prmt.b32 $0, $3, $5, $1;", "=r,r,r,r,r,r,r",
                                               [tl.join(sel, sel), tl.join(lo, lo), tl.join(hi, hi)], dtype=tl.bfloat16,
                                               is_pure=True, pack=2)  # [R, 4, b, a, h, e]
        else:
            codes = tl.join(tl.join(_codes2(words, 0, 0), _codes2(words, 1, 0)),
                            tl.join(_codes2(words, 0, 1), _codes2(words, 1, 1)))  # [R, 4, b, a, h, e]
            if LOWP:
                levels = tl.load(vlev16_ptr + codes)
            else:
                levels = tl.load(vlev_ptr + codes)
        return tl.permute(levels, (0, 3, 2, 4, 1, 5)).reshape(R, 64)  # [R, a, b, h, q, e]: t = 16 (2 a + b) + 8 h + 2 q + e

    @triton.jit
    def _code4(words, s: tl.constexpr, h: tl.constexpr, e: tl.constexpr):
        """The 4-bit code of slot ``32 w + 16 s + 8 h + 2 q + e`` in word ``4 w + q``: bits ``4 (4 e + 2 h + s)``."""
        return ((words >> (4 * (4 * e + 2 * h + s))) & 15).to(tl.int32)

    @triton.jit
    def _u4(words, k: tl.constexpr):
        """Codes ``k`` and ``k + 4`` of each word at bit 3 of its halves, under bfloat16 1.0: ``1 + code / 16``."""
        if k == 0:
            placed = words << 3
        else:
            placed = words >> (4 * k - 3)
        return (placed & _U4_MASK) | _U4_BASE

    _U4_PAIR = tl.constexpr(tuple("{ .reg .b32 t; %s.b32 t, $1, %d; lop3.b32 $0, t, 0x%08X, 0x%08X, 0xEA; }"
                                  % ("shl" if k == 0 else "shr", 3 if k == 0 else 4 * k - 3, 0x78 * 0x10001,
                                     UNIFORM4_BASE * 0x10001) for k in range(4)))

    @triton.jit
    def _u4_pair(words, k: tl.constexpr):
        """[R, 4, e]: the bfloat16 pair ``1 + code / 16`` of codes ``k`` and ``k + 4`` of each word (:func:`_u4`'s bits
        as the operand register, in one assembly block)."""
        text: tl.constexpr = _U4_PAIR[k]
        return tl.inline_asm_elementwise(text, "=r,r,r", [tl.join(words, words)], dtype=tl.bfloat16, is_pure=True, pack=2)

    @triton.jit
    def _codes4(w, e: tl.constexpr):
        """[R, 4, s, h]: the codes of slots ``e`` of words ``w`` [R, 4]."""
        return tl.join(tl.join(_code4(w, 0, 0, e), _code4(w, 1, 0, e)), tl.join(_code4(w, 0, 1, e), _code4(w, 1, 1, e)))

    @triton.jit
    def _half_levels4(w0, w1, vlev_ptr, vlev16_ptr, LEVELS: tl.constexpr, LOWP: tl.constexpr, ASM: tl.constexpr):
        """uint32 words [R, 4] ``4 w + q`` of R channels (``w0``, ``w1``) -> the 4-bit levels [R, 64], column ``t`` the
        tile's slot ``t``. Uniform levels as ``(code - 7.5) / 16`` (the kernel takes 16 times the output, as for
        token-major 4-bit codes): on a GPU each register is one shift and mask of a word plus one paired add;
        ``LEVELS`` = 3: as ``1 + code / 16``, the shift and mask alone (the kernel takes the offset off once)."""
        R: tl.constexpr = w0.shape[0]
        if ASM and LEVELS == 3:  # 1 + code / 16 as the operand: each register one shift and one logic operation
            b0 = tl.join(tl.join(_u4_pair(w0, 0), _u4_pair(w0, 1)), tl.join(_u4_pair(w0, 2), _u4_pair(w0, 3)))
            b1 = tl.join(tl.join(_u4_pair(w1, 0), _u4_pair(w1, 1)), tl.join(_u4_pair(w1, 2), _u4_pair(w1, 3)))
            levels = tl.permute(tl.join(b0, b1), (0, 1, 3, 4, 5, 2))  # [R, 4, e, s, h, w] -> [R, 4, s, h, w, e]
        elif ASM and LEVELS == 1:
            b0 = tl.join(tl.join(_u4(w0, 0), _u4(w0, 1)), tl.join(_u4(w0, 2), _u4(w0, 3)))  # [R, 4, s, h]: k = s + 2 h
            b1 = tl.join(tl.join(_u4(w1, 0), _u4(w1, 1)), tl.join(_u4(w1, 2), _u4(w1, 3)))
            bits = tl.join(b0, b1)  # [R, 4, s, h, w]
            levels = tl.inline_asm_elementwise(_U4_ASM, "=r,r,r", [tl.join(bits, bits)], dtype=tl.bfloat16, is_pure=True,
                                               pack=2)  # [R, 4, s, h, w, e]
        else:
            codes = tl.join(tl.join(_codes4(w0, 0), _codes4(w1, 0)), tl.join(_codes4(w0, 1), _codes4(w1, 1)))
            if LEVELS == 3:
                levels = codes.to(tl.float32) * 0.0625 + 1.0
            elif LOWP:
                levels = tl.load(vlev16_ptr + codes)
            else:
                levels = tl.load(vlev_ptr + codes)
            if LEVELS == 1:
                levels = levels * 0.0625
        return tl.permute(levels, (0, 4, 2, 3, 1, 5)).reshape(R, 64)  # [R, w, s, h, q, e]: t = 32 w + 16 s + 8 h + 2 q + e

    @triton.jit
    def _tile_words(vtile, g: tl.constexpr, VBITS: tl.constexpr):
        """Channel group ``g``'s words of the tile at int32 pointer ``vtile`` (``2 VBITS`` words a channel), as
        :func:`_words_levels` takes them: rows ``r`` with bit 3 clear (``a0``, ``a1``), then set (``b0``, ``b1``), one
        word a thread a load; 2-bit codes fill ``a0`` and ``b0`` (``a1``, ``b1`` repeat them)."""
        i = tl.arange(0, 32)
        q = tl.arange(0, 4)
        WPC: tl.constexpr = 2 * VBITS  # words a channel
        half = vtile + (g * 64 + i % 8 + 16 * (i // 8))[:, None] * WPC + q[None, :]  # rows 16 k + r, r < 8
        a0 = tl.load(half).to(tl.uint32, bitcast=True)
        b0 = tl.load(half + 8 * WPC).to(tl.uint32, bitcast=True)
        a1, b1 = a0, b0
        if VBITS == 4:
            a1 = tl.load(half + 4).to(tl.uint32, bitcast=True)
            b1 = tl.load(half + 8 * WPC + 4).to(tl.uint32, bitcast=True)
        return a0, a1, b0, b1

    @triton.jit
    def _words_levels(a0, a1, b0, b1, lut, vlev_ptr, vlev16_ptr, VBITS: tl.constexpr, LEVELS: tl.constexpr,
                      LOWP: tl.constexpr, ASM: tl.constexpr):
        """A channel group's levels [64 channels, 64 slots] from its tile's words (:func:`_tile_words`)."""
        if VBITS == 2:
            la = _half_levels(a0, lut, vlev_ptr, vlev16_ptr, LOWP, ASM)
            lb = _half_levels(b0, lut, vlev_ptr, vlev16_ptr, LOWP, ASM)
        else:
            la = _half_levels4(a0, a1, vlev_ptr, vlev16_ptr, LEVELS, LOWP, ASM)
            lb = _half_levels4(b0, b1, vlev_ptr, vlev16_ptr, LEVELS, LOWP, ASM)
        both = tl.join(la, lb).reshape(4, 8, 64, 2)  # [k, r, t, bit 3]
        return tl.permute(both, (0, 3, 1, 2)).reshape(64, 64)

    @triton.jit
    def _operand(x, ASM: tl.constexpr):
        """bfloat16 ``x`` as it is; where the products are Ampere ones (``ASM`` = 2:
        :func:`kvweave.kernels.lowbit_dense.ampere_products`), behind an instruction the compiler may not look past.
        Triton picks an Ampere product's operand layout from the narrowest load behind its operands, halved where a
        join lies on the way: the levels (made with joins) and the
        probabilities (one-byte log8 scales) took the layout of one-byte loads, four tokens a thread where the tile's
        words give two and two, and every step moved the levels between lanes into it (Triton 3.6, 2-bit values at
        head_dim 128: 32 lane shuffles and 64 selects a step)."""
        if ASM == 2:
            x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)
        return x

    @triton.jit
    def _tile_value_step(acc, pg, alpha, a0, a1, b0, b1, lut, vlev_ptr, vlev16_ptr, VBITS: tl.constexpr,
                         LEVELS: tl.constexpr, LOWP: tl.constexpr, ASM: tl.constexpr):
        """A channel group's running output [64 channels, G] (rows in channel order) after the probabilities ``pg``
        [64 slots, G] (times the group's scales) meet the levels of its tile's words (:func:`_tile_words`)."""
        levels = _words_levels(a0, a1, b0, b1, lut, vlev_ptr, vlev16_ptr, VBITS, LEVELS, LOWP, ASM)
        acc = acc * alpha[None, :]
        if LOWP:
            acc = tl.dot(_operand(levels.to(tl.bfloat16), ASM), pg.to(tl.bfloat16), acc)  # pg: _probabilities
        else:
            acc = tl.dot(levels.to(tl.float32), pg, acc, input_precision="ieee")
        return acc
