"""Property-based tests (hypothesis): every registered quantizer's round trip stays within the error bound
its format states, on random shapes, magnitudes from tiny to huge, data patterns and outliers.

The bounds, read from each quantizer's docstring and code (:data:`BOUNDS` holds one check per registered
quantizer; a quantizer registered without one fails ``test_every_registered_quantizer_has_a_stated_bound``):

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
- ``channel-group``: per channel over groups of ``group`` tokens, the ``outliers`` elements of each token
  farthest from their channel's median stored exactly (float16) and left out of the ranges; ``levels =
  "uniform"``: zero point and scale as KIVI's, every other element within ``scale / 2``; ``levels =
  "normal"``: every other element restored to the nearest of the levels ``mean + std * z``.
- ``channel-alloc``: as ``channel-group`` (uniform), each channel with the width the group's allocation gave
  it: within half its stored step at ``b >= 1`` bits, half its range at 0 bits; the allocation greedy-optimal.
- ``rotated-token``: per token, after a fixed orthogonal rotation ``Q`` of the channels; in the rotated
  space ``levels = "uniform"`` keeps every element within ``scale / 2`` (so ``||x - x^|| <= ||scale / 2||``
  over the vector's groups, ``Q`` being orthogonal) and ``levels = "normal"`` takes the nearest level.

Beyond what the stored fields hold, each format refuses the input with a ``ValueError`` naming the
quantizer, the largest magnitude and the limit (never a silent infinite scale restoring NaN): float16
scales hold ``absmax <= L * 65504`` (int8-block 8319008, int4-group 458528); kivi and channel-group hold
``|x| <= 65504``, rotated-token rotated elements up to 65504. The property tests draw magnitudes from
1e-8 (subnormal float16 scales) to beyond those limits and check both sides.
"""

from __future__ import annotations

import importlib
import re
from typing import Callable

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, assume, given, settings, strategies as st  # noqa: E402

from kvweave.core import plugins  # noqa: E402
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


# ============================================================================================ low-bit
def _registered(name: str) -> type:
    """The class registered as quantizer ``name`` (skips when no installed plugin registers it)."""
    components = plugins.catalog().components["quantizers"]
    if name not in components:
        pytest.skip(f"no quantizer '{name}' is registered here")
    return components[name].factory


def _normal_levels(quantizer) -> torch.Tensor:
    return torch.tensor(importlib.import_module(type(quantizer).__module__).normal_levels(quantizer.bits))


def _nearest(
    values: torch.Tensor, restored: torch.Tensor, center: torch.Tensor, spread: torch.Tensor, levels: torch.Tensor,
    slack: torch.Tensor | float = 0.0,
) -> torch.Tensor:
    """Whether each of ``restored`` is (up to float32 rounding, plus ``slack``) the level ``center + spread * z``
    nearest to ``values``."""
    candidates = center[..., None] + spread[..., None] * levels  # [..., L]
    best = (values[..., None] - candidates).abs().amin(-1)
    rounding = 2.0**-20 * (values.abs() + center.abs() + 2 * spread.abs())
    return (values - restored).abs() <= best + rounding + slack


def check_channel_group(quantizer, x: torch.Tensor) -> None:
    """Per channel over groups of tokens, the outliers exact, the rest within the format's bound."""
    if refused_beyond_float16(quantizer, "channel-group", x, float(x.abs().max())):
        return
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    assert restored.shape == x.shape
    assert bool(torch.isfinite(restored).all())
    outlier = torch.zeros_like(x, dtype=torch.bool)
    if quantizer.outliers:
        outlier.scatter_(-1, packed["outlier_index"].long(), True)
        assert int(outlier.sum()) == x[..., 0].numel() * quantizer.outliers  # k distinct channels per token
        assert torch.equal(restored[outlier], x.to(torch.float16).float()[outlier]), "outliers not stored exactly"
    tokens, width = x.shape[-2:]
    shape = (*x.shape[:-2], tokens // quantizer.group, quantizer.group, width)
    grouped, error, kept = x.reshape(shape), (restored - x).abs().reshape(shape), ~outlier.reshape(shape)
    if quantizer.levels == "normal":
        mean, std = packed["mean"].float().unsqueeze(-2), packed["std"].float().unsqueeze(-2)
        nearest = _nearest(grouped, restored.reshape(shape), mean.expand(shape), std.expand(shape), _normal_levels(quantizer))
        assert bool(nearest[kept].all()), "not the nearest level"
        return
    levels = 2**quantizer.bits - 1
    zero, scale = packed["zero"].float(), packed["scale"].float()  # [..., groups, C]
    low = grouped.masked_fill(~kept, float("inf")).amin(-2)
    high = grouped.masked_fill(~kept, -float("inf")).amax(-2)
    some = torch.isfinite(low)  # a channel group with an element that is not an outlier
    assert bool((zero <= low)[some].all()), "zero point above the minimum of the non-outliers"
    assert bool((zero + levels * scale >= high - 2.0**-22 * (high.abs() + zero.abs()))[some].all()), "range not covered"
    wanted = (high - zero) / levels
    assert bool((scale >= wanted)[some].all()), "scale rounded down"
    assert bool((scale <= wanted * (1 + 2.0**-10) + FLOAT16.smallest_normal * FLOAT16.eps)[some].all()), "scale too coarse"
    # every non-outlier within half the stored step, subnormal scales included (encoded with the stored step)
    slack = 2.0**-22 * (grouped.abs() + zero.abs()[..., None, :])
    assert bool((error <= scale[..., None, :] / 2 + slack)[kept].all()), "beyond half a stored step"


def token_group_case(draw, quantizer):
    """``(quantizer, x)``: x [*leading, tokens, width] in whole token groups, at a width the quantizer takes."""
    width = draw(st.sampled_from(WIDTHS))
    assume(_accepts(quantizer, width))
    leading = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2).map(tuple))
    tokens = quantizer.tokens_per_group() * draw(st.integers(1, 3))
    return quantizer, draw(tensors((*leading, tokens), width, low=-8.0, high=5.0))


@st.composite
def channel_group_cases(draw, factory):
    return token_group_case(draw, factory(
        bits=draw(st.sampled_from((2, 3, 4))), group=draw(st.sampled_from((1, 2, 4, 8))),
        outliers=draw(st.integers(0, 2)), levels=draw(st.sampled_from(("uniform", "normal"))),
    ))


@PROPERTY
@given(st.data())
def test_channel_group_keeps_outliers_exact_and_the_rest_within_its_bound(data):
    quantizer, x = data.draw(channel_group_cases(_registered("channel-group")))
    check_channel_group(quantizer, x)


def check_channel_alloc(quantizer, x: torch.Tensor) -> None:
    """Per channel over groups of tokens with the group's bits spread over the channels: the outliers exact,
    every token ``mean_bits * C`` bits, a channel of ``b >= 1`` bits within half its stored step, one of 0
    bits within half its range, and no bit movable to a channel whose error it would cut more."""
    if refused_beyond_float16(quantizer, "channel-alloc", x, float(x.abs().max())):
        return
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    assert restored.shape == x.shape and bool(torch.isfinite(restored).all())
    tokens, width = x.shape[-2:]
    assert packed["codes"].shape[-1] * 8 == round(quantizer.mean_bits * width)  # the same bits for every token
    outlier = torch.zeros_like(x, dtype=torch.bool)
    if quantizer.outliers:
        outlier.scatter_(-1, packed["outlier_index"].long(), True)
        assert torch.equal(restored[outlier], x.to(torch.float16).float()[outlier]), "outliers not stored exactly"
    bits = packed["bits"].long()
    per_channel = torch.cat((bits, bits), -1) if quantizer.pairs else bits  # [..., groups, C]
    assert bool((per_channel <= quantizer.max_bits).all())
    shape = (*x.shape[:-2], tokens // quantizer.group, quantizer.group, width)
    grouped, error, kept = x.reshape(shape), (restored - x).abs().reshape(shape), ~outlier.reshape(shape)
    low = grouped.masked_fill(~kept, float("inf")).amin(-2)
    high = grouped.masked_fill(~kept, -float("inf")).amax(-2)
    some = torch.isfinite(low)
    zero, scale = packed["zero"].float(), packed["scale"].float()
    coded = some & (per_channel > 0)
    assert bool((zero <= low)[coded].all()), "zero point above the minimum of the non-outliers"
    assert bool((scale >= (high - zero) / (2.0**per_channel - 1).clamp_min(1))[coded].all()), "scale rounded down"
    slack = 2.0**-22 * (grouped.abs() + zero.abs()[..., None, :]) + FLOAT16.eps * (high - low).abs()[..., None, :].nan_to_num(0)
    # 0 bits: half the range, plus the float16 rounding of the stored midpoint
    bound = torch.where(per_channel > 0, scale / 2, (high - low) / 2 + zero.abs() * 2.0**-11 + 2.0**-25)
    assert bool((error <= bound.nan_to_num(0)[..., None, :] + slack)[kept].all()), "beyond the bound of its width"
    # greedy optimality: the last bit of any entry cut its error at least as much as a further bit would cut another's
    cost = torch.where(some, high - low, 0).square()  # a channel of outliers only has no range
    if quantizer.pairs:
        cost = cost[..., : width // 2] + cost[..., width // 2 :]
    last = torch.where(bits > 0, cost * 4.0 ** (1 - bits.float()), torch.inf).amin(-1)
    following = torch.where(bits < quantizer.max_bits, cost * 4.0 ** (-bits.float()), 0).amax(-1)
    assert bool((last >= following * (1 - 1e-5)).all()), "a bit would cut more error elsewhere"


@st.composite
def channel_alloc_cases(draw, factory):
    return token_group_case(draw, factory(
        mean_bits=draw(st.sampled_from((1.0, 2.5, 3.0, 3.125, 3.5, 4.0, 6.0))), group=draw(st.sampled_from((1, 2, 4, 8))),
        outliers=draw(st.integers(0, 2)), pairs=draw(st.booleans()), max_bits=draw(st.sampled_from((4, 8))),
    ))


@PROPERTY
@given(st.data())
def test_channel_alloc_keeps_outliers_exact_and_each_channel_within_its_widths_bound(data):
    quantizer, x = data.draw(channel_alloc_cases(_registered("channel-alloc")))
    check_channel_alloc(quantizer, x)


def check_rotated_token(quantizer, x: torch.Tensor) -> None:
    """Per token in the rotated space: the uniform bound (and its norm in the original space), or the nearest level."""
    width = x.shape[-1]
    rotation = importlib.import_module(type(quantizer).__module__).rotation_matrix(quantizer.rotation, quantizer.seed, width)
    assert torch.allclose(rotation @ rotation.T, torch.eye(width), atol=1e-5), "the rotation is not orthogonal"
    largest = float((x @ rotation.T).abs().max())  # the rotated elements are what the float16 fields must hold
    assume(abs(largest - FLOAT16.max) > 1e-4 * FLOAT16.max)  # not on the limit, where float32 rounding decides
    if refused_beyond_float16(quantizer, "rotated-token", x, largest):
        return
    packed = quantizer.quantize(x)
    restored = quantizer.dequantize(packed, torch.float32)
    assert restored.shape == x.shape
    assert bool(torch.isfinite(restored).all())
    size = min(quantizer.group, width)
    shape = (*x.shape[:-1], width // size, size)
    y, y_hat = (x @ rotation.T).reshape(shape), (restored @ rotation.T).reshape(shape)
    scale = packed["scale"].float()  # [..., groups]
    zero = packed["zero"].float() if "zero" in packed else torch.zeros_like(scale)
    norm = x.norm(dim=-1, keepdim=True)[..., None]  # float32 rounding of the two rotations
    slack = 1e-5 * norm + 2.0**-20 * zero.abs()[..., None]
    if quantizer.levels == "normal":
        nearest = _nearest(y, y_hat, zero[..., None].expand(shape), scale[..., None].expand(shape), _normal_levels(quantizer), slack)
        assert bool(nearest.all()), "not the nearest level"
        return
    # every rotated element within half the stored step, subnormal scales included (encoded with the stored step)
    error = (y - y_hat).abs()
    assert bool((error <= scale[..., None] / 2 + slack).all()), "beyond half a stored step (rotated)"
    # Q orthogonal: the error's norm is kept, so it is within the norm of the half steps of the vector's groups
    bound = ((scale / 2).square().sum(-1) * size).sqrt()
    assert bool(((restored - x).norm(dim=-1) <= bound * (1 + 1e-4) + 1e-5 * norm[..., 0, 0]).all()), "norm bound"


@st.composite
def rotated_token_cases(draw, factory):
    quantizer = factory(
        bits=draw(st.sampled_from((2, 3, 4))), group=draw(st.sampled_from((2, 4, 8, 16, 32, 64))),
        rotation=draw(st.sampled_from(("hadamard", "random", "none"))), seed=draw(st.integers(0, 1000)),
        symmetric=draw(st.booleans()), levels=draw(st.sampled_from(("normal", "uniform"))),
    )
    width = draw(st.sampled_from(WIDTHS))
    assume(_accepts(quantizer, width))
    return quantizer, draw(tensors(draw(st.lists(st.integers(1, 3), max_size=2).map(tuple)), width, low=-8.0, high=5.0))


@PROPERTY
@given(st.data())
def test_rotated_token_is_within_its_bound_in_the_rotated_space(data):
    quantizer, x = data.draw(rotated_token_cases(_registered("rotated-token")))
    check_rotated_token(quantizer, x)


# ============================================================================================ every quantizer
#: registered quantizer name -> (the class it is registered as, or None: looked up in the catalog; the
#: property test of its stated bound)
BOUNDS: dict[str, tuple[type | None, Callable]] = {
    "int8-block": (Int8BlockQuantizer, test_int8_block_is_within_half_a_step_of_its_block_absmax),
    "int4-group": (Int4GroupQuantizer, test_int4_group_is_within_half_a_step_of_its_group_absmax),
    "kivi": (KiviQuantizer, test_kivi_is_within_half_a_stored_step_on_its_axis),
    "none": (NoQuantizer, test_none_is_exact_or_rounds_once_to_its_dtype),
    "channel-group": (None, test_channel_group_keeps_outliers_exact_and_the_rest_within_its_bound),
    "channel-alloc": (None, test_channel_alloc_keeps_outliers_exact_and_each_channel_within_its_widths_bound),
    "rotated-token": (None, test_rotated_token_is_within_its_bound_in_the_rotated_space),
}


def test_every_registered_quantizer_has_a_stated_bound():
    catalog = plugins.catalog()
    registered = {info.name for info in catalog.iter_components("quantizers")}
    assert registered <= set(BOUNDS), f"quantizers without a property test of their bound: {sorted(registered - set(BOUNDS))}"
    for name in registered:  # the class tested is the one registered under that name
        expected = BOUNDS[name][0]
        assert expected is None or catalog.get("quantizers", name).factory is expected, name


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


@pytest.mark.parametrize("outliers", [0, 1])
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_channel_group_small_ranges_keep_half_a_step(bits, outliers):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 8) * 1e-4
    x[..., 3] *= 1e-3  # a channel down to 1e-7
    quantizer = _registered("channel-group")(bits=bits, group=4, outliers=outliers)
    packed = quantizer.quantize(x)
    scale = packed["scale"].float()
    assert bool((scale < FLOAT16.smallest_normal).any()), "not the subnormal case"
    error = (quantizer.dequantize(packed, torch.float32) - x).abs()
    exact = torch.zeros_like(x, dtype=torch.bool)
    if outliers:
        exact.scatter_(-1, packed["outlier_index"].long(), True)
    assert bool((error <= scale.repeat_interleave(4, dim=-2) / 2 * (1 + 1e-6))[~exact].all())


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("magnitude", [1e-5, 1e-7])
def test_rotated_token_uniform_small_ranges_keep_half_a_step(magnitude, bits, symmetric):
    torch.manual_seed(0)
    x = torch.randn(4, 16) * magnitude
    quantizer = _registered("rotated-token")(bits=bits, group=8, levels="uniform", symmetric=symmetric)
    packed = quantizer.quantize(x)
    scale = packed["scale"].float()
    assert bool((scale < FLOAT16.smallest_normal).all()), "not the subnormal case"
    rotation = importlib.import_module(type(quantizer).__module__).rotation_matrix("hadamard", 0, 16)
    y, y_hat = x @ rotation.T, quantizer.dequantize(packed, torch.float32) @ rotation.T
    slack = 1e-6 * x.norm(dim=-1, keepdim=True)  # float32 rounding of the two rotations
    assert bool(((y - y_hat).abs() <= scale.repeat_interleave(8, dim=-1) / 2 * (1 + 1e-6) + slack).all())


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


def test_a_huge_outlier_is_refused_too():
    # channel-group stores outliers as float16: a spike beyond 65504 cannot be kept exactly, nor in a range
    x = torch.randn(2, 8, 8)
    x[1, 2, 5] = -1e5
    for levels in ("uniform", "normal"):
        for outliers in (0, 1):
            quantizer = _registered("channel-group")(bits=2, group=4, outliers=outliers, levels=levels)
            with pytest.raises(ValueError, match=r"^channel-group: largest magnitude 100000 is beyond the limit 65504 "):
                quantizer.quantize(x)


@pytest.mark.parametrize("levels", ["normal", "uniform"])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rotated_token_refuses_rotated_elements_beyond_float16(levels, symmetric):
    factory = _registered("rotated-token")
    plain = factory(bits=2, group=8, rotation="none", levels=levels, symmetric=symmetric)
    with pytest.raises(ValueError, match=r"^rotated-token: largest magnitude 70000 is beyond the limit 65504 "):
        plain.quantize(_alternating(7e4))
    # the rotation can gather a vector's norm into one element: 8 x 30000 rotates to one of 84853
    rotated = factory(bits=2, group=8, levels=levels, symmetric=symmetric)
    x = torch.full((1, 8), 3e4) * importlib.import_module(factory.__module__).rotation_matrix("hadamard", 0, 8)[0] * 8**0.5
    with pytest.raises(ValueError, match=r"^rotated-token: largest magnitude 8485[0-9.]+ is beyond the limit 65504 "):
        rotated.quantize(x)


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


def test_low_bit_blocks_at_the_limit_are_kept_within_their_bound():
    x = _alternating(65504.0).reshape(2, 1, 8).expand(2, 4, 8).contiguous()
    group = _registered("channel-group")(bits=2, group=4, outliers=0)
    packed = group.quantize(x)
    restored = group.dequantize(packed, torch.float32)
    assert bool(torch.isfinite(restored).all())
    assert bool(((restored - x).abs() <= packed["scale"].float().amax() / 2).all())
    for symmetric in (True, False):
        token = _registered("rotated-token")(bits=2, group=8, rotation="none", levels="uniform", symmetric=symmetric)
        packed = token.quantize(x)
        restored = token.dequantize(packed, torch.float32)
        assert bool(torch.isfinite(restored).all())
        assert bool(((restored - x).abs() <= packed["scale"].float().amax() / 2).all())
