"""``none``: stores values as they are, in the model's dtype or a chosen float dtype."""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import Quantizer
from kvweave.core.lazy import DtypeTable, torch
from kvweave.core.params import choice

_DTYPES = DtypeTable("float16", "bfloat16", "float32")


@attrs.frozen
class NoQuantizer(Quantizer):
    """No quantization. ``dtype = "input"`` keeps the dtype values arrive in (bit-exact storage)."""

    head_sharding: ClassVar[str] = "head-local"

    packed_format: ClassVar[str] = "none.v1"

    dtype: str = attrs.field(
        default="input",
        validator=choice(["input", *_DTYPES]),
        metadata={"doc": "storage dtype: 'input' keeps the incoming dtype"},
    )

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"values": x if self.dtype == "input" else x.to(_DTYPES[self.dtype])}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return packed["values"].to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        stored = dtype if self.dtype == "input" else _DTYPES[self.dtype]
        return width * torch.empty((), dtype=stored).element_size()


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("none", NoQuantizer)
