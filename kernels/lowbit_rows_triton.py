"""The ``dense`` kernel's codes read token by token (:mod:`kvweave.kernels.lowbit_dense_triton`): 32-bit words of 2- or
4-bit codes unpacked into channel order (the keys that are not read by code places), and a step's value product from
token-major value words (values not stored in tiles): 2-bit codes through a byte permute whose 8 bytes are the four
levels' bfloat16 bits, 4-bit uniform codes as ``(code - 7.5) / 16`` from their bits (on a GPU: inline assembly; other
4-bit levels from the table). Without triton the module defines nothing (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.lowbit_dense import UNIFORM4_OFFSET
    from kvweave.kernels.lowbit_tile_triton import _SEL_ADD, _SEL_MUL, _U4_ASM, _u4
    from kvweave.kernels.lowbit_triton import _level

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
    def _j4(a, b, c, d):
        """[..., 4]: ``a, b, c, d`` in that order along a new last axis (two joins, each adding an axis)."""
        return tl.join(tl.join(a, c), tl.join(b, d))

    @triton.jit
    def _pair_channels(col):
        """The channel each column of :func:`_uniform4_tiles`' tiles holds: within a word's 8 columns, column ``2 k + h``
        is code ``k + 4 h`` (codes ``k`` and ``k + 4`` share a 32-bit register)."""
        r = col % 8
        return col - r + r // 2 + 4 * (r % 2)

    @triton.jit
    def _uniform4_tiles(words, ASM: tl.constexpr):
        """uint32 words [N, W] of 4-bit codes -> bfloat16 [N, W * 8] (columns: :func:`_pair_channels`), each code's
        centred level over 16, ``(code - 7.5) / 16``: the bits of ``1 + code / 16`` (codes ``k`` and ``k + 4`` at bits 3
        and 19 of one register, a shift and a logic operation) plus -1.46875 in one paired add on a GPU (exact)."""
        bits = _j4(_u4(words, 0), _u4(words, 1), _u4(words, 2), _u4(words, 3))  # [N, W, 4]: k
        if ASM:  # the word for each element of a pair: Triton packs two bfloat16 results of the assembly in one register
            two = tl.join(bits, bits)
            tiles = tl.inline_asm_elementwise(_U4_ASM, "=r,r,r", [two], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            offset = tl.full([1], UNIFORM4_OFFSET, tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32)
            lo = (bits & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32) + offset
            hi = (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True).to(tl.float32) + offset
            tiles = tl.join(lo, hi).to(tl.bfloat16)
        return tiles.reshape(words.shape[0], words.shape[1] * 8)

    @triton.jit
    def _quad_channels(col):
        """The channel each column of :func:`_lut_tiles`' tiles holds: within a word's 16 columns, column ``4 k + i``
        is code ``k + 4 i``."""
        r = col % 16
        return col - r + r // 4 + 4 * (r % 4)

    @triton.jit
    def _lut_tiles(words, lut, vlev_ptr, vlev16_ptr, l0, l1, LEVELS: tl.constexpr, LOWP: tl.constexpr, ASM: tl.constexpr):
        """uint32 words [N, W] of 2-bit value codes -> their levels [N, W * 16] (columns: :func:`_quad_channels`). On a
        GPU a byte permute is the table: the four levels' bfloat16 bits are its 8 bytes (``lut``), and a byte per code,
        ``0x22 x code + 0x10`` (the level's two byte numbers), picks two levels at once; four codes take a shift, a
        mask, a multiply-add, two permutes and a shift."""
        y0 = words & 0x03030303  # codes k, k + 4, k + 8, k + 12, a byte each
        y1 = (words >> 2) & 0x03030303
        y2 = (words >> 4) & 0x03030303
        y3 = (words >> 6) & 0x03030303
        if ASM:
            z0 = y0 * _SEL_MUL + _SEL_ADD  # a byte per code: the byte numbers of its level, 2 code and 2 code + 1
            z1 = y1 * _SEL_MUL + _SEL_ADD
            z2 = y2 * _SEL_MUL + _SEL_ADD
            z3 = y3 * _SEL_MUL + _SEL_ADD
            sel = tl.join(_j4(z0, z1, z2, z3), _j4(z0 >> 16, z1 >> 16, z2 >> 16, z3 >> 16))  # [N, W, 2, 2, 2]
            word = lut.to(tl.int64)  # an argument that fits 32 bits comes as int32
            lo = tl.zeros_like(sel) + (word & 0xFFFFFFFF).to(tl.uint32)
            hi = tl.zeros_like(sel) + ((word >> 32) & 0xFFFFFFFF).to(tl.uint32)
            levels = tl.inline_asm_elementwise("prmt.b32 $0, $3, $5, $1;", "=r,r,r,r,r,r,r",
                                               [tl.join(sel, sel), tl.join(lo, lo), tl.join(hi, hi)], dtype=tl.bfloat16,
                                               is_pure=True, pack=2).reshape(words.shape[0], words.shape[1] * 16)
        else:
            c0 = _j4(y0 & 3, y1 & 3, y2 & 3, y3 & 3)  # [N, W, 4] per byte i: codes k + 4 i over k
            c1 = _j4((y0 >> 8) & 3, (y1 >> 8) & 3, (y2 >> 8) & 3, (y3 >> 8) & 3)
            c2 = _j4((y0 >> 16) & 3, (y1 >> 16) & 3, (y2 >> 16) & 3, (y3 >> 16) & 3)
            c3 = _j4((y0 >> 24) & 3, (y1 >> 24) & 3, (y2 >> 24) & 3, (y3 >> 24) & 3)
            codes = _j4(c0, c1, c2, c3).reshape(words.shape[0], words.shape[1] * 16).to(tl.int32)
            if LOWP:
                levels = tl.load(vlev16_ptr + codes)
            else:
                levels = _level(codes, vlev_ptr, 2, LEVELS, l0, l1, False)
        return levels

    @triton.jit
    def _value_step(acc, pg, alpha, vwords, lut, vlev_ptr, vlev16_ptr, l0, l1, VBITS: tl.constexpr, LEVELS: tl.constexpr,
                    LOWP: tl.constexpr, ASM: tl.constexpr):
        """One channel group's running output, transposed (``acc`` [VGROUP, G]), after the probabilities ``pg`` [BLOCK,
        G] (times the group's scales) meet the value words [BLOCK, GW]: 2-bit codes read through their four levels by
        :func:`_lut_tiles`, 4-bit uniform ones as ``(code - 7.5) / 16`` by :func:`_uniform4_tiles` (the caller takes 16
        times the output), other 4-bit levels from the table (its bfloat16 copy on a GPU). The channels of ``acc`` are
        in its tiles' order (:func:`_value_channels`)."""
        if VBITS == 2:
            levels = _lut_tiles(vwords, lut, vlev_ptr, vlev16_ptr, l0, l1, LEVELS, LOWP, ASM)
        elif LEVELS == 1:
            levels = _uniform4_tiles(vwords, ASM)
        elif LOWP:
            levels = tl.load(vlev16_ptr + _words_codes(vwords, VBITS))
        else:
            levels = tl.load(vlev_ptr + _words_codes(vwords, VBITS))
        acc = acc * alpha[None, :]
        if LOWP:
            acc = tl.dot(tl.trans(levels.to(tl.bfloat16)), pg.to(tl.bfloat16), acc)
        else:
            acc = tl.dot(tl.trans(levels.to(tl.float32)), pg, acc, input_precision="ieee")
        return acc
