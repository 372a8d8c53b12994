"""Shared helpers of the built-in quantizers: the scale dtypes they accept, the absmax scales of the
symmetric formats, and the refusal of inputs beyond what a format's stored fields can hold."""

from __future__ import annotations

import math

from kvweave.core.deferred import defer
from kvweave.core.lazy import DtypeTable, torch

SCALE_DTYPES = DtypeTable("float16", "bfloat16", "float32")

#: float16's largest finite value: the limit of the magnitudes a float16 zero point / stored value can hold
#: (``torch.finfo(torch.float16).max``, written out so that importing this module does not import torch)
FLOAT16_MAX = 65504.0


def absmax_limit(levels: int, scale_dtype: torch.dtype) -> tuple[float, str]:
    """The largest block absmax whose scale ``absmax / levels`` the scale dtype holds, and why: ``levels *
    65504`` for float16 scales (127 -> 8319008, 7 -> 458528); for bfloat16 and float32 scales float32's
    largest value (the encoder works in float32; only a float64 input can go beyond it)."""
    largest = torch.finfo(scale_dtype).max
    if levels * largest < torch.finfo(torch.float32).max:
        return levels * largest, f"{levels} x the largest {str(scale_dtype).removeprefix('torch.')} scale, {largest:.7g}"
    return torch.finfo(torch.float32).max, "the largest float32, the encoder's working dtype"


def subnormal_up(wanted: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 ``wanted`` (>= 0) rounded to ``dtype``: to nearest where that is a normal number of ``dtype``,
    *up* to the next multiple of the subnormal spacing (float16: ``2**-24``) where ``wanted`` is below
    ``dtype``'s normal range, so the stored value never falls short of it there."""
    info = torch.finfo(dtype)
    nearest = wanted.to(dtype)
    if dtype == torch.float32:
        return nearest
    # the subnormal spacing is 2**-exponent (float16 24, bfloat16 133): scale by it in two exact steps of
    # powers of two that float32 holds, round up to an integer, and scale back
    exponent = round(-math.log2(info.smallest_normal * info.eps))
    first, second = exponent // 2, exponent - exponent // 2
    up = (torch.ceil(wanted * 2.0**first * 2.0**second) * 2.0**-first * 2.0**-second).to(dtype)
    return torch.where(wanted < info.smallest_normal, up, nearest)


def check_magnitude(
    quantizer: str, magnitude: torch.Tensor, limit: float, reason: str, source: torch.Tensor | None = None
) -> None:
    """Raise ``ValueError`` when an element of ``magnitude`` (per-group statistics, or the values) is beyond
    ``limit`` (an infinite one included; NaN is the caller's to refuse, as the engine does), naming
    ``quantizer``, the largest magnitude seen (of ``source`` when given: the input in its own dtype) and the
    limit. One host read, made with the forward's other checks where a flush defers them (:mod:`kvweave.core.deferred`;
    ``magnitude``'s largest is then named: the per-group statistics are the input's magnitudes)."""
    if magnitude.numel() == 0:
        return

    def fail(largest: float) -> None:
        raise ValueError(
            f"{quantizer}: largest magnitude {largest:.7g} is beyond the limit {limit:.7g} ({reason}); "
            "scale the input down or use a quantizer whose stored fields hold it"
        )

    over = (magnitude.abs() > limit).any()
    stats = magnitude.detach()
    if defer(over, lambda: fail(float(stats.abs().amax()))):
        return
    if bool(over):
        fail(float((magnitude if source is None else source).detach().abs().amax()))


def absmax_scales(grouped: torch.Tensor, levels: int, scale_dtype: torch.dtype, quantizer: str) -> torch.Tensor:
    """Per-group symmetric scales: ``grouped`` [..., groups, size] -> [..., groups] with absmax / levels.

    The scale is rounded to ``scale_dtype`` first, so quantization uses exactly the scale that is stored:
    to nearest where the result is a normal number of ``scale_dtype``, and *up* where it would be below the
    normal range (float16: ``absmax / levels < 2**-14``, about 6.1e-5): a subnormal has fewer significant
    bits, and rounded up it still covers the absmax, so no code is clamped and every element stays within
    half the stored step (a stored step at most ``absmax / levels + 2**-24`` for float16). A group of zeros
    gets scale 1 (its codes are all zero either way). A group whose ``absmax / levels`` the scale dtype
    cannot hold (:func:`absmax_limit`) is refused with a ``ValueError`` naming ``quantizer``.
    """
    absmax = grouped.abs().amax(dim=-1)
    check_magnitude(quantizer, absmax, *absmax_limit(levels, scale_dtype))
    scales = subnormal_up(absmax.float() / levels, scale_dtype)
    return torch.where(scales == 0, torch.ones_like(scales), scales)
