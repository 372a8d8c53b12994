"""``int4-group``: symmetric 4-bit codes, two per byte, with one scale per group of channels.

Shapes: ``x`` [..., C] -> ``packed`` uint8 [..., C / 2] (channel 2i in the low nibble, 2i+1 in the
high nibble, each stored as code + 8) and ``scales`` [..., C / group]. A 64-channel vector with
group 32 costs 32 + 4 bytes instead of 128 at 16 bits (3.56x).

Bound: the stored scale ``s`` is the group's ``absmax / 7`` rounded to the scale dtype (to nearest; *up*
where that is below the dtype's normal range, float16: ``absmax < 7 * 2**-14``, about 4.3e-4), and the
codes are computed with that stored ``s``, so every element is within ``s / 2`` of ``code * s``: within
``absmax / 7 * (1 + eps) / 2`` for a normal scale (``eps`` of the scale dtype, ``2**-10`` for float16),
within ``(absmax / 7 + 2**-24) / 2`` for a subnormal float16 one. A group whose ``absmax / 7`` the scale
dtype cannot hold (float16 scales: absmax above ``7 * 65504 = 458528``) is refused with a ``ValueError``
naming ``int4-group``, the largest magnitude and the limit, never stored as an infinite scale. (Restored
values are within the bound in float32; dequantized *to float16*, one that lands beyond 65504 (a block
whose absmax is within a half step of 65504, or beyond it) overflows that dtype.)
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import Quantizer
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

from ._scales import SCALE_DTYPES, absmax_scales


@attrs.frozen
class Int4GroupQuantizer(Quantizer):
    """Round-to-nearest int4 in [-7, 7] with an absmax scale per ``group`` channels."""

    head_sharding: ClassVar[str] = "head-local"

    packed_format: ClassVar[str] = "int4-group.v1"

    group: int = attrs.field(default=32, validator=integer(2, 4096), metadata={"doc": "channels per scale (even)"})
    scale_dtype: str = attrs.field(default="float16", validator=choice(SCALE_DTYPES), metadata={"doc": "dtype of the stored scales"})

    @group.validator
    def _even(self, attribute, value) -> None:
        if value % 2:
            raise ValueError(f"'group' must be even (two 4-bit codes share a byte), got {value}")

    def _group_for(self, width: int) -> int:
        return min(self.group, width)

    def check_width(self, width: int, where: str) -> None:
        group = self._group_for(width)
        if width % 2 or width % group:
            raise ModelError(
                f"{where}: int4-group needs an even width divisible by group={self.group}, got width {width}"
            )

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        width = x.shape[-1]
        group = self._group_for(width)
        grouped = x.reshape(*x.shape[:-1], width // group, group)
        scales = absmax_scales(grouped, 7, SCALE_DTYPES[self.scale_dtype], "int4-group")
        codes = torch.round(grouped.float() / scales.float().unsqueeze(-1)).clamp_(-7, 7).to(torch.int16) + 8
        codes = codes.reshape(*x.shape[:-1], width // 2, 2)
        packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
        return {"packed": packed, "scales": scales}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        data, scales = packed["packed"], packed["scales"]
        low = (data & 0x0F).to(torch.int8) - 8
        high = (data >> 4).to(torch.int8) - 8
        codes = torch.stack((low, high), dim=-1).reshape(*data.shape[:-1], data.shape[-1] * 2)
        grouped = codes.reshape(*scales.shape, -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
        return grouped.reshape(codes.shape)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        scale_bytes = torch.empty((), dtype=SCALE_DTYPES[self.scale_dtype]).element_size()
        return width / 2 + (width // self._group_for(width)) * scale_bytes


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("int4-group", Int4GroupQuantizer)
