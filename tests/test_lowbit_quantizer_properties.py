"""Property-based tests (hypothesis) of the low-bit quantizers ``channel-group``, ``channel-alloc`` and
``rotated-token``: each round trip stays within the error bound its format states, on the random data of
test_quantizer_properties.py (random shapes, magnitudes from tiny to huge, data patterns and outliers);
fixed cases check float16's edges. :data:`BOUNDS` holds one check per registered quantizer; a quantizer
registered without one fails ``test_every_registered_quantizer_has_a_stated_bound``.

The bounds, read from each quantizer's docstring and code:

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
quantizer, the largest magnitude and the limit (never a silent infinite scale restoring NaN):
channel-group and channel-alloc hold ``|x| <= 65504``, rotated-token rotated elements up to 65504. The
property tests draw magnitudes from 1e-8 (subnormal float16 scales) to beyond those limits and check both
sides.
"""

from __future__ import annotations

import importlib
from typing import Callable

import pytest
import torch

pytest.importorskip("hypothesis")
from hypothesis import assume, given, strategies as st  # noqa: E402

from kvweave.core import plugins  # noqa: E402
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer  # noqa: E402
from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer  # noqa: E402
from kvweave.plugins.quantizers.kivi import KiviQuantizer  # noqa: E402
from kvweave.plugins.quantizers.passthrough import NoQuantizer  # noqa: E402

import test_quantizer_properties as properties  # noqa: E402 - the other quantizers' property tests (BOUNDS)
from test_quantizer_properties import (  # noqa: E402 - the random data, the settings and the float16 checks
    FLOAT16, PROPERTY, WIDTHS, _accepts, _alternating, refused_beyond_float16, tensors,
)


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
    "int8-block": (Int8BlockQuantizer, properties.test_int8_block_is_within_half_a_step_of_its_block_absmax),
    "int4-group": (Int4GroupQuantizer, properties.test_int4_group_is_within_half_a_step_of_its_group_absmax),
    "kivi": (KiviQuantizer, properties.test_kivi_is_within_half_a_stored_step_on_its_axis),
    "none": (NoQuantizer, properties.test_none_is_exact_or_rounds_once_to_its_dtype),
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
