"""The ``@triton.jit`` kernels of :mod:`kvweave.kernels.pack`: a flushed block's codes computed and packed into their
bit streams in one pass. Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernels need triton; the quantizers' torch paths do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _stream_part(codes, offsets, stream, BNB: tl.constexpr):
        """``stream`` [BT, BNB] (float32: each token's bytes as numbers) with integer ``codes`` [BT, CB] (each below 256)
        put in, channel ``c`` at bit ``offsets[c]`` of its token's little-endian stream. A code shifted to its bit in a
        byte spans that byte and the next; every byte gathers its channels' parts by a product with a one-hot [CB, BNB]
        matrix of where each part goes. The parts hold disjoint bits of at most 255, so the sums are the bitwise or,
        exact in float16 operands and float32 sums, in any order (a token's channels may come in several parts)."""
        shifted = codes << (offsets % 8)[None, :]
        byte = offsets // 8
        slots = tl.arange(0, BNB)
        low = (shifted & 255).to(tl.float16)
        high = (shifted >> 8).to(tl.float16)
        to_low = (byte[:, None] == slots[None, :]).to(tl.float16)
        to_high = ((byte + 1)[:, None] == slots[None, :]).to(tl.float16)
        return tl.dot(high, to_high, tl.dot(low, to_low, stream))

    @triton.jit
    def _store_stream(stream, out_ptr, tokens, live, NB: tl.constexpr, BNB: tl.constexpr):
        """The ``NB`` bytes of each token's ``stream`` [BT, BNB] (:func:`_stream_part`) stored in row ``tokens`` [BT] of
        ``out_ptr`` (where ``live``)."""
        slots = tl.arange(0, BNB)
        tl.store(out_ptr + tokens[:, None] * NB + slots[None, :], stream.to(tl.uint8), mask=live[:, None] & (slots[None, :] < NB))

    @triton.jit
    def _rounded_code(value, most):
        """``value`` float32 clamped to [0, ``most``] and rounded half to even (as torch.round), as int32."""
        value = tl.minimum(tl.maximum(value, 0.0), most)
        return ((value + 12582912.0) - 12582912.0).to(tl.int32)  # 1.5 * 2**23: float32 addition rounds to even

    @triton.jit
    def _affine_varwidth_kernel(
        x_ptr, zero_ptr, scale_ptr, bits_ptr, outlier_ptr, out_ptr,
        C: tl.constexpr, BC: tl.constexpr, GROUP: tl.constexpr, BT: tl.constexpr, K: tl.constexpr,
        NB: tl.constexpr, BNB: tl.constexpr, CB: tl.constexpr,
    ):
        """``channel-alloc``'s codes of ``BT`` tokens (one program; a group of ``GROUP`` tokens holds whole tiles):
        ``x`` [M, C] (tokens of all rows in order), per group row ``zero``, ``scale`` float16 and ``bits`` uint8 [M /
        GROUP, C]; code ``round((x - zero) / step)`` clamped to ``0 .. 2**bits - 1`` (``step`` the scale, 1 where it
        is 0), 0 at the token's ``K`` outlier channels (``outlier`` uint8 [M, K]); packed into the token's stream of
        ``NB`` bytes, channel ``c`` at the sum of the widths before it. The channels go ``CB`` at a time (their one-hot
        products' operands then fit the shared memory at head_dim 256)."""
        first = tl.program_id(0) * BT
        tokens = first + tl.arange(0, BT)
        row = first // GROUP
        stream = tl.zeros([BT, BNB], dtype=tl.float32)
        base = tl.zeros([], dtype=tl.int32)  # the widths of the channels before this part
        for c0 in tl.static_range(0, BC, CB):
            chan = c0 + tl.arange(0, CB)
            cm = chan < C
            x = tl.load(x_ptr + tokens[:, None] * C + chan[None, :], mask=cm[None, :], other=0.0).to(tl.float32)
            zero = tl.load(zero_ptr + row * C + chan, mask=cm, other=0.0).to(tl.float32)
            scale = tl.load(scale_ptr + row * C + chan, mask=cm, other=0.0).to(tl.float32)
            bits = tl.load(bits_ptr + row * C + chan, mask=cm, other=0).to(tl.int32)
            step = tl.where(scale == 0.0, 1.0, scale)
            most = ((1 << bits) - 1).to(tl.float32)
            codes = _rounded_code(tl.div_rn(x - zero[None, :], step[None, :]), most[None, :])
            for k in tl.static_range(K):
                outlier = tl.load(outlier_ptr + tokens * K + k).to(tl.int32)
                codes = tl.where(chan[None, :] == outlier[:, None], 0, codes)
            stream = _stream_part(codes, base + tl.cumsum(bits, 0) - bits, stream, BNB)
            base += tl.sum(bits, 0)
        _store_stream(stream, out_ptr, tokens, tokens >= 0, NB, BNB)

    @triton.jit
    def _nearest_level_kernel(
        y_ptr, center_ptr, spread_ptr, edges_ptr, out_ptr, count,
        C: tl.constexpr, BC: tl.constexpr, WIDTH: tl.constexpr, BT: tl.constexpr, BITS: tl.constexpr,
        CENTERED: tl.constexpr, NB: tl.constexpr, BNB: tl.constexpr, RAW: tl.constexpr, CB: tl.constexpr,
    ):
        """``rotated-token``'s normal-level codes of ``BT`` of the ``count`` tokens (one program): ``y`` [count, C] float32
        (the rotated vectors), per token and group of ``WIDTH`` channels ``spread`` (and, with ``CENTERED``, ``center``)
        float32 [count, C / WIDTH]; a code counts the cell edges ``center + spread * edge`` (``edges`` float32
        [2**BITS - 1]) below the element; packed ``BITS`` a code, code ``c`` at bit ``c * BITS`` of the token's ``NB``
        bytes, or with ``RAW`` a code a byte. The channels go ``CB`` at a time (as :func:`_affine_varwidth_kernel`'s)."""
        tokens = tl.program_id(0) * BT + tl.arange(0, BT)
        live = tokens < count
        groups: tl.constexpr = C // WIDTH
        stream = tl.zeros([BT, BNB], dtype=tl.float32)
        for c0 in tl.static_range(0, BC, CB):
            chan = c0 + tl.arange(0, CB)
            inside = live[:, None] & (chan < C)[None, :]
            y = tl.load(y_ptr + tokens[:, None] * C + chan[None, :], mask=inside, other=0.0)
            where = tokens[:, None] * groups + chan[None, :] // WIDTH
            spread = tl.load(spread_ptr + where, mask=inside, other=0.0)
            if CENTERED:
                center = tl.load(center_ptr + where, mask=inside, other=0.0)
            else:
                center = tl.zeros_like(spread)
            codes = tl.zeros([BT, CB], dtype=tl.int32)
            for e in tl.static_range((1 << BITS) - 1):
                codes += (y > center + spread * tl.load(edges_ptr + e)).to(tl.int32)
            codes = tl.where(inside, codes, 0)
            if RAW:  # a code a byte [count, C], for a layout packed after (values in tiles of tokens)
                tl.store(out_ptr + tokens[:, None] * C + chan[None, :], codes.to(tl.uint8), mask=inside)
            else:
                stream = _stream_part(codes, chan * BITS, stream, BNB)
        if not RAW:
            _store_stream(stream, out_ptr, tokens, live, NB, BNB)
