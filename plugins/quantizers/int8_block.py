"""``int8-block``: symmetric 8-bit codes with one scale per block of channels.

Shapes: ``x`` [..., C] -> ``codes`` int8 [..., C] and ``scales`` [..., C / block] (float16 by default),
so a 64-channel vector with block 64 costs 64 + 2 bytes instead of 128 at 16 bits (1.94x).

Bound: the stored scale ``s`` is the block's ``absmax / 127`` rounded to the scale dtype (to nearest; *up*
where that is below the dtype's normal range, float16: ``absmax < 127 * 2**-14``, about 7.8e-3), and the
codes are computed with that stored ``s``, so every element is within ``s / 2`` of ``code * s``: within
``absmax / 127 * (1 + eps) / 2`` for a normal scale (``eps`` of the scale dtype, ``2**-10`` for float16),
within ``(absmax / 127 + 2**-24) / 2`` for a subnormal float16 one. A block whose ``absmax / 127`` the scale
dtype cannot hold (float16 scales: absmax above ``127 * 65504 = 8319008``) is refused with a ``ValueError``
naming ``int8-block``, the largest magnitude and the limit, never stored as an infinite scale. (Restored
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
class Int8BlockQuantizer(Quantizer):
    """Round-to-nearest int8 in [-127, 127] with an absmax scale per ``block`` channels."""

    head_sharding: ClassVar[str] = "head-local"

    packed_format: ClassVar[str] = "int8-block.v1"

    block: int = attrs.field(default=64, validator=integer(1, 4096), metadata={"doc": "channels per scale"})
    scale_dtype: str = attrs.field(default="float16", validator=choice(SCALE_DTYPES), metadata={"doc": "dtype of the stored scales"})

    def _block_for(self, width: int) -> int:
        return min(self.block, width)

    def check_width(self, width: int, where: str) -> None:
        block = self._block_for(width)
        if width % block != 0:
            raise ModelError(f"{where}: int8-block block={self.block} does not divide the width {width}; use a divisor of {width}")

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        width = x.shape[-1]
        block = self._block_for(width)
        grouped = x.reshape(*x.shape[:-1], width // block, block)
        scales = absmax_scales(grouped, 127, SCALE_DTYPES[self.scale_dtype], "int8-block")
        codes = torch.round(grouped.float() / scales.float().unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
        return {"codes": codes.reshape(x.shape), "scales": scales}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes, scales = packed["codes"], packed["scales"]
        grouped = codes.reshape(*scales.shape, -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
        return grouped.reshape(codes.shape)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        scale_bytes = torch.empty((), dtype=SCALE_DTYPES[self.scale_dtype]).element_size()
        return width + (width // self._block_for(width)) * scale_bytes


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("int8-block", Int8BlockQuantizer)
