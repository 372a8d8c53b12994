"""``kivi``: asymmetric 2- or 4-bit codes, keys per channel over groups of tokens, values per token.

Liu, Yuan, Jin, Zhong, Xu, Braverman, Chen, Hu: "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache" (ICML 2024, arXiv:2402.02750). Keys have outlier channels, so each channel of a group of
``group`` consecutive tokens gets its own scale and zero point; values are quantized per token, with a
scale and zero point per ``value_group`` channels. Codes are ``round((x - zero) / scale)`` in
``0 .. 2**bits - 1``, packed along the channels (``8 / bits`` per byte). The full-precision residual of
the paper is the pipeline's exact recent window; tokens leave it ``block_tokens`` at a time, a multiple
of ``group``.

Stored fields: keys ``codes`` uint8 [..., n, C * bits / 8] with ``scale`` and ``zero`` float16
[..., n / group, C] (one row per group of tokens); values ``codes`` uint8 [..., n, C * bits / 8] with
``scale`` and ``zero`` float16 [..., n, C / value_group]. The zero point is rounded down and the scale up
to float16 (in float16's subnormal range too, below ``2**-14``: to the next multiple of ``2**-24``), and
the codes are computed with the stored scale, so every code's error is at most ``scale / 2`` with the
stored scale, whatever the group's range: ``scale <= (max - zero) / (2**bits - 1) * (1 + 2**-10)`` where
that is a normal float16, ``<= (max - zero) / (2**bits - 1) + 2**-24`` below. A group held exactly by its
zero point (constant, and a float16 value) gets scale 0 and codes 0. Inputs must lie within float16's
range (``|x| <= 65504``, which the zero points and scales must hold); beyond it ``quantize`` raises a
``ValueError`` naming ``kivi``, the largest magnitude and the limit. (Restored values are within the bound
in float32; dequantized *to float16*, one that lands beyond 65504, at most half a step above a group
maximum near 65504, overflows that dtype.)
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import Quantizer
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

from ._bitpack import safe_step
from ._scales import FLOAT16_MAX, check_magnitude


def _bits(_instance, attribute, value) -> None:
    if value not in (2, 4):
        raise ValueError(f"'{attribute.alias}' must be 2 or 4, got {value!r}")


def affine(x: torch.Tensor, low: torch.Tensor, high: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes of ``x`` for the range [low, high] (broadcastable), with float16 scale and zero point chosen
    so that the range is covered after rounding them to float16."""
    levels = (1 << bits) - 1
    zero = low.to(torch.float16)
    zero = torch.where(zero.float() > low, torch.nextafter(zero, torch.full_like(zero, -float("inf"))), zero)
    wanted = (high - zero.float()) / levels
    scale = wanted.to(torch.float16)
    scale = torch.where(scale.float() < wanted, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)
    return zero, scale, levels


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., C] -> [..., C * bits / 8]: code ``j`` of each byte at bits ``j * bits``."""
    per_byte = 8 // bits
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    out = torch.zeros(grouped.shape[:-1], dtype=torch.uint8, device=codes.device)
    for j in range(per_byte):
        out |= grouped[..., j] << (j * bits)
    return out


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    per_byte = 8 // bits
    mask = (1 << bits) - 1
    parts = [(packed >> (j * bits)) & mask for j in range(per_byte)]
    return torch.stack(parts, dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * per_byte)


def _check_range(low: torch.Tensor, high: torch.Tensor, x: torch.Tensor) -> None:
    """Refuse groups beyond float16's range (their zero point or scale would be infinite)."""
    check_magnitude(
        "kivi", torch.maximum(low.abs(), high.abs()), FLOAT16_MAX,
        "the largest float16: zero points and scales are float16", source=x,
    )


def _encode(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """Codes with the *stored* scale (subnormal float16 ones included: the decoder multiplies by exactly this
    step); a zero scale (a constant group held exactly by its zero point) encodes as code 0."""
    return torch.round((x - zero.float()) / safe_step(scale)).clamp_(0, levels)


@attrs.frozen
class KiviKeys(Quantizer):
    """KIVI's key side: per channel, over groups of ``group`` tokens (the token axis is -2)."""

    bits: int = attrs.field(default=2, validator=_bits)
    group: int = attrs.field(default=32, validator=integer(1, 1 << 16))

    def tokens_per_group(self) -> int:
        return self.group

    def check_width(self, width: int, where: str) -> None:
        if width % (8 // self.bits):
            raise ModelError(f"{where}: kivi packs {8 // self.bits} codes per byte; width {width} is not a multiple")

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        tokens, width = x.shape[-2:]
        if tokens % self.group:
            raise ValueError(f"kivi: keys come in blocks of {tokens} tokens, not a multiple of group={self.group}")
        grouped = x.float().reshape(*x.shape[:-2], tokens // self.group, self.group, width)
        low, high = grouped.amin(dim=-2), grouped.amax(dim=-2)
        _check_range(low, high, x)
        zero, scale, levels = affine(grouped, low, high, self.bits)
        codes = _encode(grouped, zero.unsqueeze(-2), scale.unsqueeze(-2), levels).reshape(x.shape)
        return {"codes": pack(codes, self.bits), "scale": scale, "zero": zero}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(packed["codes"], self.bits).float()
        scale = packed["scale"].float().repeat_interleave(self.group, dim=-2)
        zero = packed["zero"].float().repeat_interleave(self.group, dim=-2)
        return (codes * scale + zero).to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        return width * self.bits / 8 + 2 * 2 * width / self.group


@attrs.frozen
class KiviValues(Quantizer):
    """KIVI's value side: per token, with a scale and zero point per ``group`` channels."""

    bits: int = attrs.field(default=2, validator=_bits)
    group: int = attrs.field(default=32, validator=integer(1, 1 << 16))

    def _group_for(self, width: int) -> int:
        return min(self.group, width)

    def check_width(self, width: int, where: str) -> None:
        if width % (8 // self.bits) or width % self._group_for(width):
            raise ModelError(
                f"{where}: kivi needs a width divisible by {8 // self.bits} and by value_group={self.group}, got {width}"
            )

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        width = x.shape[-1]
        group = self._group_for(width)
        grouped = x.float().reshape(*x.shape[:-1], width // group, group)
        low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
        _check_range(low, high, x)
        zero, scale, levels = affine(grouped, low, high, self.bits)
        codes = _encode(grouped, zero.unsqueeze(-1), scale.unsqueeze(-1), levels).reshape(x.shape)
        return {"codes": pack(codes, self.bits), "scale": scale, "zero": zero}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(packed["codes"], self.bits).float()
        scale, zero = packed["scale"].float(), packed["zero"].float()
        grouped = codes.reshape(*scale.shape, -1) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        return grouped.reshape(codes.shape).to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        return width * self.bits / 8 + 2 * 2 * width / self._group_for(width)


@attrs.frozen
class KiviQuantizer(Quantizer):
    """Keys per channel over ``group`` tokens, values per token over ``value_group`` channels, 2 or 4 bits."""

    head_sharding: ClassVar[str] = "head-local"

    bits: int = attrs.field(default=2, validator=_bits, metadata={"doc": "bits per code (2 or 4)"})
    group: int = attrs.field(default=32, validator=integer(1, 1 << 16), metadata={"doc": "tokens per key scale (divides block_tokens)"})
    value_group: int = attrs.field(default=32, validator=integer(1, 1 << 16), metadata={"doc": "channels per value scale"})
    scale_dtype: str = attrs.field(default="float16", validator=choice(("float16",)), metadata={"doc": "dtype of scales and zero points"})

    def for_kind(self, kind: str) -> Quantizer:
        return KiviKeys(self.bits, self.group) if kind == "keys" else KiviValues(self.bits, self.value_group)

    def tokens_per_group(self) -> int:
        return 1  # used directly (no kind given), it quantizes per token, as for values

    def check_width(self, width: int, where: str) -> None:
        self.for_kind("keys").check_width(width, where)
        self.for_kind("values").check_width(width, where)

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.for_kind("values").quantize(x)

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.for_kind("values").dequantize(packed, dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        return (self.for_kind("keys").bytes_per_vector(width, dtype) + self.for_kind("values").bytes_per_vector(width, dtype)) / 2


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("kivi", KiviQuantizer)
