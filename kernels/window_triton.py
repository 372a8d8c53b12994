"""The ``@triton.jit`` kernel of :func:`kvweave.kernels.window.append_int8`: one decode token appended to an int8
exact window and the window read back, in one pass. Without triton the module defines no kernel (``triton`` is None)."""

from __future__ import annotations

try:  # the kernel needs triton; the torch path of ExactTokens does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

if triton is not None:

    @triton.jit
    def _rounded(value, dtype: tl.constexpr):
        """float32 ``value`` as ``dtype``, rounded to nearest even (to bfloat16 through its bits: Triton's interpreter
        truncates that conversion, the GPU rounds; the lowbit combine's output takes it too)."""
        if dtype == tl.bfloat16:
            bits = value.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            value = tl.where(value != value, value, bits.to(tl.float32, bitcast=True))  # NaN kept NaN
        return value.to(dtype)

    @triton.jit
    def _encoded_rows(x):
        """Tokens' channels ``x`` [T, BD] as the int8 window stores them: the codes (float32 integers: round half to even
        of ``x / scale`` clamped to +-127; 0 for a vector holding NaN or infinity), the float16 scales ``absmax / 127``
        [T] (NaN for such a vector) and the largest finite magnitudes the range check sees [T] (0 for such a vector)."""
        xf = x.to(tl.float32)
        mag = tl.abs(xf)
        finite = mag < float("inf")  # false for NaN too
        bad = tl.max(tl.where(finite, 0, 1), 1) > 0
        absmax = tl.max(tl.where(finite, mag, 0.0), 1)
        scale16 = tl.div_rn(absmax, 127.0).to(tl.float16)
        scale16 = tl.where(bad, float("nan"), scale16.to(tl.float32)).to(tl.float16)
        step = tl.where(scale16.to(tl.float32) > 0, scale16.to(tl.float32), 1.0)
        y = tl.minimum(tl.maximum(tl.div_rn(xf, step[:, None]), -127.0), 127.0)
        y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: float32 addition rounds to the nearest even integer
        return tl.where(bad[:, None], 0.0, y), scale16, tl.where(bad, 0.0, absmax)

    @triton.jit
    def _encoded(x, BD: tl.constexpr):
        """One token's channels ``x`` [BD] encoded as :func:`_encoded_rows` encodes rows: codes [BD], scale, magnitude."""
        y, scale16, seen = _encoded_rows(tl.reshape(x, (1, BD)))
        return tl.reshape(y, (BD,)), tl.max(scale16.to(tl.float32), 0).to(tl.float16), tl.max(seen, 0)

    @triton.jit
    def _put_new(x_ptr, codes_ptr, scale_ptr, read_ptr, worst_ptr, slot, chan, cm, D: tl.constexpr):
        """The token at ``x_ptr`` encoded (:func:`_encoded`) into token ``slot`` of the window's codes and scales, written
        to the read-back as it arrived, its largest finite magnitude raised into ``worst``."""
        x = tl.load(x_ptr + chan, mask=cm, other=0.0)
        y, scale16, seen = _encoded(x, x.shape[0])
        tl.store(codes_ptr + slot * D + chan, y.to(tl.int8), mask=cm)
        tl.store(scale_ptr + slot, scale16)
        tl.store(read_ptr + slot * D + chan, x.to(read_ptr.dtype.element_ty), mask=cm)
        tl.atomic_max(worst_ptr, seen)

    @triton.jit(do_not_specialize=["held"])
    def _window_append_kernel(
        old_codes_ptr, old_scale_ptr, new_ptr, codes_ptr, scale_ptr, read_ptr, worst_ptr,
        held, new_stride,
        D: tl.constexpr, BD: tl.constexpr, TB: tl.constexpr,
    ):
        """One (batch row, head): the ``held`` stored tokens (``old_codes`` int8 [R, held, D], ``old_scale`` float16
        [R, held]) copied to the window one token longer (``codes``, ``scale``) and read back into ``read`` [R, held + 1,
        D] (code x scale in float32, rounded to ``read``'s dtype); then the new token (``new`` row stride ``new_stride``)
        encoded at ``held`` (scale ``absmax / 127`` rounded to float16, codes round-half-even of ``x / scale`` clamped
        to +-127; a vector holding NaN or infinity gets a NaN scale and zero codes) and written to ``read`` as it
        arrived; its absmax (0 for a non-finite vector) raised into ``worst`` [1] float32."""
        row = tl.program_id(0).to(tl.int64)
        chan = tl.arange(0, BD)
        cm = chan < D
        length = held + 1
        for t0 in range(0, held, TB):
            tok = t0 + tl.arange(0, TB)
            ok = tok < held
            both = ok[:, None] & cm[None, :]
            codes = tl.load(old_codes_ptr + (row * held + tok)[:, None] * D + chan[None, :], mask=both, other=0)
            scale = tl.load(old_scale_ptr + row * held + tok, mask=ok, other=0.0)
            at = (row * length + tok)[:, None] * D + chan[None, :]
            tl.store(codes_ptr + at, codes, mask=both)
            tl.store(scale_ptr + row * length + tok, scale, mask=ok)
            value = codes.to(tl.float32) * scale.to(tl.float32)[:, None]
            tl.store(read_ptr + at, _rounded(value, read_ptr.dtype.element_ty), mask=both)
        _put_new(new_ptr + row * new_stride, codes_ptr, scale_ptr, read_ptr, worst_ptr, row * length + held, chan, cm, D)

    @triton.jit(do_not_specialize=["capacity"])
    def _window_put_kernel(
        codes_ptr, scale_ptr, read_ptr, new_ptr, fill_ptr, worst_ptr,
        capacity, new_stride,
        D: tl.constexpr, BD: tl.constexpr,
    ):
        """One (batch row, head) of a window kept in buffers of ``capacity`` tokens (``codes`` int8 [R, capacity, D],
        ``scale`` float16 [R, capacity], ``read`` [R, capacity, D] in the tokens' dtype): the new token (``new`` row
        stride ``new_stride``) encoded at index ``fill`` (read from ``fill_ptr``, int32 [1]: the tokens held before it),
        as :func:`_window_append_kernel` encodes it, and written to ``read`` as it arrived; the token before it, written
        there as it arrived by the step before, replaced by its read-back (code x scale, rounded to ``read``'s dtype). No
        held token is copied: the step's work and addresses do not depend on how many the window holds."""
        row = tl.program_id(0).to(tl.int64)
        chan = tl.arange(0, BD)
        cm = chan < D
        fill = tl.load(fill_ptr).to(tl.int64)
        prev = tl.maximum(fill - 1, 0)  # an index inside the buffers either way
        written = cm & (chan * 0 + fill > 0)  # none before the first token
        at_prev = (row * capacity + prev) * D + chan
        old = tl.load(codes_ptr + at_prev, mask=written, other=0)
        value = old.to(tl.float32) * tl.load(scale_ptr + row * capacity + prev).to(tl.float32)
        tl.store(read_ptr + at_prev, _rounded(value, read_ptr.dtype.element_ty), mask=written)
        _put_new(new_ptr + row * new_stride, codes_ptr, scale_ptr, read_ptr, worst_ptr, row * capacity + fill, chan, cm, D)

    @triton.jit
    def _window_encode_kernel(
        x_ptr, codes_ptr, scale_ptr, worst_ptr,
        heads, tokens, stride_b, stride_h, stride_n,
        D: tl.constexpr, BD: tl.constexpr, TB: tl.constexpr,
    ):
        """``TB`` tokens of one (batch row, head) of a prompt ``x`` [B, H, n, D] (strides ``stride_*``, channels side by
        side) encoded by :func:`_encoded_rows`: ``codes`` int8 [B x H, n, D], ``scale`` float16 [B x H, n]; the
        largest finite magnitude raised into ``worst`` [1] float32 (a vector with NaN or infinity counts 0)."""
        row = tl.program_id(0).to(tl.int64)
        tok = tl.program_id(1) * TB + tl.arange(0, TB)
        live = tok < tokens
        chan = tl.arange(0, BD)
        both = live[:, None] & (chan < D)[None, :]
        base = (row // heads) * stride_b + (row % heads) * stride_h
        y, scale16, seen = _encoded_rows(tl.load(x_ptr + base + tok[:, None].to(tl.int64) * stride_n + chan[None, :], mask=both, other=0.0))
        at = row * tokens + tok
        tl.store(codes_ptr + at[:, None] * D + chan[None, :], y.to(tl.int8), mask=both)
        tl.store(scale_ptr + at, scale16, mask=live)
        tl.atomic_max(worst_ptr, tl.max(tl.where(live, seen, 0.0), 0))
