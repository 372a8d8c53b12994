"""The operands of DepthWeave-KV's ``tiles`` pass (:mod:`kvweave.kernels.depthweave_tiles_triton`) made in registers:
population counts, pointers and words of a width, the residual tile cut from a token's code and scale words, and the
int8 coefficients as float16 numbers (by byte permutes on a GPU). Without triton the module defines nothing
(``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:
    from kvweave.kernels.decode_triton import _popcount

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
    def _residual_tile(cw, sw, RMAX: tl.constexpr, RP: tl.constexpr, GROUP: tl.constexpr, COLUMNS: tl.constexpr):
        """The residual coordinates (float16) of the tokens whose words are ``cw``, ``sw`` ([BLOCK], or [BLOCK, 1] with
        ``COLUMNS``), as [BLOCK, RP]: coordinate
        ``k`` (nibble ``k`` of the code word less 8, times half ``k // GROUP`` of the scale word) in column
        ``k * RP / RMAX``, zeros between. Coordinates past a token's rank meet a zero scale: its scale word ends there,
        every level's rank being a multiple of ``GROUP``. The numbers are made in float16: ``1024 + nibble`` from its
        bits, less 1032. (Made [BLOCK, RMAX] and spread by joins with zeros, the tile came out in another column order
        on the GPU than in the interpreter; the zeros are written instead.)"""
        c = tl.arange(0, RP)
        step: tl.constexpr = RP // RMAX
        k = c // step
        if not COLUMNS:
            cw = cw[:, None]
            sw = sw[:, None]
        nib = (cw >> (4 * k).to(cw.dtype)[None, :]) & 15
        half = (sw >> (16 * (k // GROUP)).to(sw.dtype)[None, :]) & 0xFFFF
        code = (nib.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0
        value = code * half.to(tl.uint16).to(tl.float16, bitcast=True)
        return tl.where(((c % step) == 0)[None, :], value, 0.0).to(tl.float16)

    @triton.jit
    def _coefficients(code, BYTES: tl.constexpr):
        """int8 codes as float16 operands. ``BYTES`` (a GPU): four codes a register made from their bits, without a
        conversion instruction a code: the sign bits flipped (one exclusive or) make each byte the unsigned ``code +
        128``, two byte permutes put each byte under the float16 exponent of 1024 (``0x6400 | byte``: ``1152 + code``),
        and one paired float16 subtraction of 1152 a register leaves ``code``, exactly (integers to 2048 are float16
        numbers). Else a conversion a code; both give the same bits."""
        if BYTES:
            return tl.inline_asm_elementwise(
                "{ .reg .b32 t, b; xor.b32 t, $2, 0x80808080; mov.b32 b, 0x64806480; "
                "prmt.b32 $0, t, 0x64646464, 0x4140; prmt.b32 $1, t, 0x64646464, 0x4342; "
                "sub.rn.f16x2 $0, $0, b; sub.rn.f16x2 $1, $1, b; }",
                "=r,=r,r", [code], dtype=tl.float16, is_pure=True, pack=4)
        return code.to(tl.float16)

    @triton.jit
    def _word_coefficients(words, BYTES: tl.constexpr):
        """int8 codes held four a 32-bit word ([N, W], code ``4 w + i`` in byte ``i`` of word ``w``) as float16 operands
        [N, 4 W] in code order: on a GPU (``BYTES``) by the byte permutes of :func:`_coefficients`, each word's four
        numbers out of the assembly as 16-bit registers; else each byte cut and converted."""
        if BYTES:
            b0, b1, b2, b3 = tl.inline_asm_elementwise(
                "{ .reg .b32 t, lo, hi, b; xor.b32 t, $4, 0x80808080; mov.b32 b, 0x64806480; "
                "prmt.b32 lo, t, 0x64646464, 0x4140; prmt.b32 hi, t, 0x64646464, 0x4342; "
                "sub.rn.f16x2 lo, lo, b; sub.rn.f16x2 hi, hi, b; mov.b32 {$0, $1}, lo; mov.b32 {$2, $3}, hi; }",
                "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
                pack=1)
        else:
            b0 = (words << 24) >> 24  # int32 words: the shifts right carry each byte's sign
            b1 = (words << 16) >> 24
            b2 = (words << 8) >> 24
            b3 = words >> 24
            b0, b1, b2, b3 = b0.to(tl.float16), b1.to(tl.float16), b2.to(tl.float16), b3.to(tl.float16)
        # [N, W, e, a] holds byte 2 e + a, so column 4 w + 2 e + a of the reshaped tile is code 4 w + 2 e + a
        return tl.join(tl.join(b0, b2), tl.join(b1, b3)).reshape(words.shape[0], 4 * words.shape[1])
