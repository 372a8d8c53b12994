"""Property-based tests (hypothesis): the round trips of the ``int8-block``, ``int4-group``, ``kivi`` and
``none`` quantizers stay within the error bound their formats state, on random shapes, magnitudes from tiny
to huge, data patterns and outliers; fixed cases check float16's edges. The random data (:func:`tensors`) is
the one the low-bit quantizers' property tests (test_lowbit_quantizer_properties.py) draw too.

The bounds, read from each quantizer's docstring and code:

- ``int8-block`` / ``int4-group``: round to nearest with a symmetric absmax scale per block (group) of
  channels, codes in [-L, L] (L = 127 / 7). The stored scale is ``absmax / L`` rounded once to the scale
  dtype (to nearest; up, to the subnormal spacing ``2**-24`` of float16, where it is below the normal
  range) and the codes are computed with it: every element is within half a stored step, ``|x - x^| <= s /
  2``, so within ``absmax / L / 2`` up to the scale dtype's rounding (``1 + eps``), or ``(absmax / L +
  2**-24) / 2`` for a subnormal float16 scale.
- ``kivi``: asymmetric codes in [0, 2^bits - 1]; keys per channel over groups of ``group`` tokens, values
  per token over groups of ``value_group`` channels. The zero point is the group's minimum rounded down to
  float16, the scale ``(max - zero) / levels`` rounded up (subnormal ones too), and "every code's error is
  at most scale / 2 with the stored scale", whatever the group's range.
- ``none``: ``dtype = "input"`` stores the values bit-exactly; another dtype stores them rounded to it.

Beyond what the stored fields hold, each format refuses the input with a ``ValueError`` naming the
quantizer, the largest magnitude and the limit (never a silent infinite scale restoring NaN): float16
scales hold ``absmax <= L * 65504`` (int8-block 8319008, int4-group 458528); kivi holds ``|x| <= 65504``.
The property tests draw magnitudes from 1e-8 (subnormal float16 scales) to beyond those limits and check
both sides.
"""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402

from kvweave.core.errors import ModelError  # noqa: E402
from kvweave.plugins.quantizers._scales import SCALE_DTYPES  # noqa: E402
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer  # noqa: E402
from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer  # noqa: E402
from kvweave.plugins.quantizers.kivi import KiviKeys, KiviQuantizer, KiviValues  # noqa: E402
from kvweave.plugins.quantizers.passthrough import NoQuantizer  # noqa: E402

PROPERTY = settings(max_examples=50, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
FLOAT16 = torch.finfo(torch.float16)
WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
PATTERNS = ("normal", "positive", "constant", "sparse", "zeros")


# ============================================================================================ data
@st.composite
def tensors(draw, leading: tuple[int, ...], width: int, low: float = -6.0, high: float = 6.0) -> torch.Tensor:
    """float32 [*leading, width]: a pattern at magnitude 10**e (e in [low, high]) plus up to 3 outliers
    10 to 1000 times larger."""
    shape = (*leading, width)
    seed = draw(st.integers(0, 2**31 - 1))
    scale = 10.0 ** draw(st.floats(low, high))
    pattern = draw(st.sampled_from(PATTERNS))
    gen = torch.Generator().manual_seed(seed)
    if pattern == "normal":
        x = torch.randn(shape, generator=gen)
    elif pattern == "positive":  # all of one sign (asymmetric formats must not waste half their range)
        x = torch.rand(shape, generator=gen) + 0.5
    elif pattern == "constant":
        x = torch.full(shape, float(torch.randn(1, generator=gen)))
    elif pattern == "sparse":
        x = torch.randn(shape, generator=gen) * (torch.rand(shape, generator=gen) < 0.2)
    else:
        x = torch.zeros(shape)
    x = x * scale
    flat = x.view(-1)
    for index, factor in draw(st.lists(st.tuples(st.integers(0, flat.numel() - 1), st.floats(1.0, 3.0)), max_size=3)):
        sign = 1.0 if index % 2 else -1.0
        flat[index] = sign * scale * 10.0**factor
    return x


leading_dims = st.lists(st.integers(1, 3), min_size=0, max_size=3).map(tuple)


def _accepts(quantizer, width: int) -> bool:
    try:
        quantizer.check_width(width, "property test")
    except ModelError:
        return False
    return True


# ============================================================================================ int8 / int4
def check_absmax(quantizer, x: torch.Tensor, levels: int, size: int) -> None:
    """The symmetric absmax formats: scale per block of ``size`` channels, codes in [-levels, levels]."""
    scale_dtype = SCALE_DTYPES[quantizer.scale_dtype]
    info = torch.finfo(scale_dtype)
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
    absmax = blocks.abs().amax(-1)
    limit = min(levels * info.max, torch.finfo(torch.float32).max)
    if float(absmax.max()) > limit:  # the scale dtype cannot hold absmax / levels: refused, naming both
        name = {127: "int8-block", 7: "int4-group"}[levels]
        largest = f"{float(absmax.max()):.7g}"
        pattern = rf"^{name}: largest magnitude {re.escape(largest)} .*limit {re.escape(f'{limit:.7g}')}"
        with pytest.raises(ValueError, match=pattern):
            quantizer.quantize(x)
        return
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    assert restored.shape == x.shape
    assert bool(torch.isfinite(restored).all())
    error = (restored - x).abs().reshape(blocks.shape)
    wanted = absmax / levels  # the step the format states, per block
    scale = packed["scales"].float()
    slack = (2.0**-22 * absmax)[..., None]  # float32 rounding of x / s and of code * s
    normal = wanted >= info.smallest_normal
    spacing = info.smallest_normal * info.eps  # the scale dtype's subnormal spacing (float16: 2**-24)
    # the stored scale is the block's absmax / levels, rounded once to the scale dtype: to nearest in the
    # normal range, up to the subnormal spacing below it
    assert torch.allclose(scale[normal], wanted[normal], rtol=info.eps, atol=0), "scale is not absmax / levels"
    subnormal = ~normal & (absmax > 0)
    assert bool(((scale >= wanted) & (scale <= wanted + spacing))[subnormal].all()), "subnormal scale not rounded up"
    # every element within half a step of the stored scale (any magnitude), and of the stated step
    assert bool((error <= scale[..., None] / 2 + slack).all()), "beyond half a stored step"
    stated = torch.where(normal, wanted * (1 + info.eps), wanted + spacing)
    assert bool((error <= stated[..., None] / 2 + slack).all()), "beyond absmax / levels / 2"


@st.composite
def int8_cases(draw):
    quantizer = Int8BlockQuantizer(block=draw(st.sampled_from((1, 2, 4, 8, 16, 32, 64))), scale_dtype=draw(st.sampled_from(tuple(SCALE_DTYPES))))
    width = draw(st.sampled_from(WIDTHS))
    assume(_accepts(quantizer, width))
    return quantizer, draw(tensors(draw(leading_dims), width, low=-8.0, high=8.0))


@st.composite
def int4_cases(draw):
    quantizer = Int4GroupQuantizer(group=draw(st.sampled_from((2, 4, 8, 16, 32, 64))), scale_dtype=draw(st.sampled_from(tuple(SCALE_DTYPES))))
    width = draw(st.sampled_from(WIDTHS))
    assume(_accepts(quantizer, width))
    return quantizer, draw(tensors(draw(leading_dims), width, low=-8.0, high=8.0))


@PROPERTY
@given(int8_cases())
def test_int8_block_is_within_half_a_step_of_its_block_absmax(case):
    quantizer, x = case
    check_absmax(quantizer, x, 127, min(quantizer.block, x.shape[-1]))


@PROPERTY
@given(int4_cases())
def test_int4_group_is_within_half_a_step_of_its_group_absmax(case):
    quantizer, x = case
    check_absmax(quantizer, x, 7, min(quantizer.group, x.shape[-1]))


# ============================================================================================ kivi
def refused_beyond_float16(quantizer, name: str, x: torch.Tensor, largest: float) -> bool:
    """Whether ``largest`` (the magnitude the format checks) is beyond float16's range; if so, quantizing
    ``x`` must raise a ValueError naming ``name``, that magnitude and the limit 65504."""
    if largest <= FLOAT16.max:
        return False
    with pytest.raises(ValueError, match=rf"^{name}: largest magnitude {re.escape(f'{largest:.7g}')} .*limit 65504"):
        quantizer.quantize(x)
    return True


def check_kivi(quantizer, x: torch.Tensor) -> None:
    """KIVI's asymmetric format on its axis: keys per channel over ``group`` tokens, values per token over
    ``group`` channels (``quantizer`` is the keys' or the values' side)."""
    if refused_beyond_float16(quantizer, "kivi", x, float(x.abs().max())):
        return
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    assert restored.shape == x.shape
    assert bool(torch.isfinite(restored).all())
    levels = 2**quantizer.bits - 1
    scale, zero = packed["scale"].float(), packed["zero"].float()
    if isinstance(quantizer, KiviKeys):  # groups of tokens (axis -2), per channel
        tokens, width = x.shape[-2:]
        grouped = x.reshape(*x.shape[:-2], tokens // quantizer.group, quantizer.group, width)
        low, high = grouped.amin(-2), grouped.amax(-2)
        error = (restored - x).abs().reshape(grouped.shape).transpose(-1, -2)  # [..., groups, C, group]
        magnitude = grouped.abs().transpose(-1, -2)
    else:  # groups of channels, per token
        size = min(quantizer.group, x.shape[-1])
        grouped = x.reshape(*x.shape[:-1], x.shape[-1] // size, size)
        low, high = grouped.amin(-1), grouped.amax(-1)
        error = (restored - x).abs().reshape(grouped.shape)
        magnitude = grouped.abs()
    assert scale.shape == zero.shape == low.shape, "scale and zero point are not per group of the stated axis"
    assert bool(torch.isfinite(scale).all() & torch.isfinite(zero).all())
    slack = 2.0**-22 * (magnitude + zero.abs()[..., None])
    # the zero point is the group's minimum rounded down (by at most one float16 step) ...
    assert bool((zero <= low).all()), "zero point above the group's minimum"
    assert bool((zero >= low - low.abs() * 2.0**-9 - 2.0**-23).all()), "zero point far below the minimum"
    # ... and the scale covers the group's range, rounded up once from (max - zero) / levels (to the
    # subnormal spacing 2**-24 below float16's normal range)
    assert bool((zero + levels * scale >= high - 2.0**-22 * (high.abs() + zero.abs())).all()), "range not covered"
    wanted = (high - zero) / levels
    assert bool((scale >= wanted).all()), "scale rounded down"
    assert bool((scale <= wanted * (1 + 2.0**-10) + FLOAT16.smallest_normal * FLOAT16.eps).all()), "scale too coarse"
    # every element within half the stored scale, subnormal scales included (the encoder uses the stored step)
    assert bool((error <= scale[..., None] / 2 + slack).all()), "beyond half a stored step"


@st.composite
def kivi_cases(draw):
    bits = draw(st.sampled_from((2, 4)))
    kind = draw(st.sampled_from(("keys", "values")))
    group = draw(st.sampled_from((1, 2, 4, 8)))
    value_group = draw(st.sampled_from((1, 2, 4, 8, 16, 32, 64)))
    quantizer = KiviQuantizer(bits=bits, group=group, value_group=value_group).for_kind(kind)
    width = draw(st.sampled_from(WIDTHS))
    assume(_accepts(quantizer, width))
    leading = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple))
    tokens = quantizer.tokens_per_group() * draw(st.integers(1, 3))
    # float16 zero points and scales: magnitudes from 1e-8 (subnormal scales) to beyond float16 (refused)
    return quantizer, draw(tensors((*leading, tokens), width, low=-8.0, high=5.0))


@PROPERTY
@given(kivi_cases())
def test_kivi_is_within_half_a_stored_step_on_its_axis(case):
    quantizer, x = case
    check_kivi(quantizer, x)


# ============================================================================================ none
@st.composite
def none_cases(draw):
    quantizer = NoQuantizer(dtype=draw(st.sampled_from(("input", "float16", "bfloat16", "float32"))))
    dtype = draw(st.sampled_from((torch.float32, torch.bfloat16, torch.float16)))
    width = draw(st.sampled_from(WIDTHS))
    return quantizer, draw(tensors(draw(leading_dims), width, low=-4.0, high=4.0)).to(dtype)


@PROPERTY
@given(none_cases())
def test_none_is_exact_or_rounds_once_to_its_dtype(case):
    quantizer, x = case
    packed = quantizer.quantize(x)
    if quantizer.dtype == "input":
        assert torch.equal(quantizer.dequantize(packed, x.dtype), x)  # bit-exact
        return
    storage = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[quantizer.dtype]
    restored = quantizer.dequantize(packed, torch.float32)
    assert torch.equal(restored, x.to(storage).float())  # rounded once, to the storage dtype
    info = torch.finfo(storage)
    x32 = x.float()
    representable = (x32.abs() >= info.smallest_normal) & (x32.abs() <= info.max)
    assert bool(((restored - x32).abs() <= x32.abs() * info.eps / 2)[representable].all())


# ============================================================================================ float16's edges
# Below float16's normal range (2**-14, about 6.1e-5) a stored scale is subnormal: the encoder must use
# exactly that stored step (rounded up, so no code is clamped), or elements restore far from their value.

@pytest.mark.parametrize(
    "quantizer, magnitude",
    [(Int8BlockQuantizer(block=8), 1e-5), (Int8BlockQuantizer(block=8), 1e-7), (Int4GroupQuantizer(group=8), 3e-7),
     (Int4GroupQuantizer(group=8), 1e-5)],
    ids=["int8-1e-5", "int8-1e-7", "int4-3e-7", "int4-1e-5"],
)
def test_tiny_blocks_keep_half_a_step(quantizer, magnitude):
    torch.manual_seed(0)
    x = torch.randn(4, 8) * magnitude  # absmax / levels below float16's smallest normal: subnormal scales
    packed = quantizer.quantize(x)
    scale = packed["scales"].float()  # [4, 1]: one block per row
    levels = 127 if isinstance(quantizer, Int8BlockQuantizer) else 7
    wanted = x.abs().amax(-1, keepdim=True) / levels
    assert bool((scale < FLOAT16.smallest_normal).all()), "not the subnormal case"
    assert bool(((scale >= wanted) & (scale <= wanted + 2.0**-24)).all()), "scale not absmax / levels rounded up"
    error = (quantizer.dequantize(packed, torch.float32) - x).abs()
    assert bool((error <= scale / 2 * (1 + 1e-6)).all())


@pytest.mark.parametrize(
    "side, magnitude", [(KiviKeys(4, 4), 1e-4), (KiviValues(4, 8), 1e-4), (KiviKeys(2, 4), 1e-7), (KiviValues(2, 8), 1e-7)],
    ids=["keys-1e-4", "values-1e-4", "keys-1e-7", "values-1e-7"],
)
def test_kivi_small_ranges_keep_half_a_step(side, magnitude):
    torch.manual_seed(0)
    x = torch.randn(8, 8) * magnitude
    packed = side.quantize(x)
    error = (side.dequantize(packed, torch.float32) - x).abs()
    scale = packed["scale"].float()
    assert bool((scale < FLOAT16.smallest_normal).any()), "not the subnormal case"
    scale = scale.repeat_interleave(4, dim=-2) if isinstance(side, KiviKeys) else scale.repeat_interleave(8, dim=-1)
    assert bool((error <= scale / 2 * (1 + 1e-6)).all())


def test_kivi_constant_groups_restore_within_half_a_step():
    # a constant float16 value: scale 0, restored exactly; a constant float16 cannot hold: a subnormal step
    for value in (0.25, 1.0001):
        x = torch.full((8, 8), value)
        for side in (KiviKeys(2, 4), KiviValues(2, 8)):
            packed = side.quantize(x)
            error = (side.dequantize(packed, torch.float32) - x).abs()
            if value == 0.25:
                assert bool((packed["scale"] == 0).all()) and bool((error == 0).all())
            else:
                assert bool((error <= packed["scale"].float().amax() / 2).all())


# Beyond float16's largest value (65504) a scale or zero point would be infinite and restore NaN: refused,
# naming the quantizer, the largest magnitude and the limit.

def _alternating(magnitude: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.full((2, 8), magnitude, dtype=dtype)
    x[:, ::2] = -magnitude
    return x


@pytest.mark.parametrize("quantizer, name, magnitude, limit", [
    (Int8BlockQuantizer(block=8), "int8-block", 1e7, "8319008"),
    (Int4GroupQuantizer(group=8), "int4-group", 5e5, "458528"),
    (KiviKeys(2, 2), "kivi", 7e4, "65504"),
    (KiviValues(2, 8), "kivi", 1e7, "65504"),
], ids=["int8", "int4", "kivi-keys", "kivi-values"])
def test_huge_blocks_are_refused_naming_the_limit(quantizer, name, magnitude, limit):
    pattern = rf"^{name}: largest magnitude {re.escape(f'{magnitude:.7g}')} is beyond the limit {limit} "
    with pytest.raises(ValueError, match=pattern):
        quantizer.quantize(_alternating(magnitude))


def test_the_limit_follows_the_scale_dtype():
    # bfloat16 / float32 scales hold what float16 ones cannot; only float64 input beyond float32 is refused
    for scale_dtype in ("bfloat16", "float32"):
        for quantizer in (
            Int8BlockQuantizer(block=8, scale_dtype=scale_dtype), Int4GroupQuantizer(group=8, scale_dtype=scale_dtype)
        ):
            x = _alternating(1e12)
            restored = quantizer.dequantize(quantizer.quantize(x), torch.float32)
            assert bool(torch.isfinite(restored).all()) and torch.allclose(restored, x, rtol=0.08)
            with pytest.raises(ValueError, match=r"largest magnitude 1e\+39 is beyond the limit 3\.402823e\+38 "):
                quantizer.quantize(_alternating(1e39, torch.float64))


@pytest.mark.parametrize("quantizer, magnitude", [
    (Int8BlockQuantizer(block=8), 127 * 65504.0), (Int4GroupQuantizer(group=8), 7 * 65504.0),
    (KiviKeys(2, 2), 65504.0), (KiviValues(4, 8), 65504.0),
], ids=["int8", "int4", "kivi-keys", "kivi-values"])
def test_blocks_at_the_limit_are_kept_within_half_a_step(quantizer, magnitude):
    x = _alternating(magnitude)
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    step = (packed["scales"] if "scales" in packed else packed["scale"]).float().amax()
    assert bool(torch.isfinite(restored).all()) and bool(((restored - x).abs() <= step / 2).all())
