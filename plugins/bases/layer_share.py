"""``layer-share``: direct cross-layer sharing -- one stored vector per token for a window of layers.

The depth-sharing baselines DepthWeave-KV compares against:

- MiniCache (Liu et al., 2024, "MiniCache: KV Cache Compression in Depth Dimension for Large Language
  Models", arXiv:2405.14366) merges the KV states of adjacent layers; ``mode = "mean"`` stores their
  average (MiniCache's merge without its magnitude/direction split and token retention).
- KVSharer (Yang et al., 2024, "KVSharer: Efficient Inference via Layer-Wise Dissimilar KV Cache
  Sharing", arXiv:2410.18517) lets a layer reuse another layer's KV cache; ``mode = "first"`` stores
  the first layer of the window and every other layer of the window reuses it (consecutive windows,
  no calibrated layer pairing).

Shapes: ``x`` [G, B, H, n, D] (G consecutive layers of a window) -> coefficients [1, B, H, n, D]
(S = 1, r = D) -> every member decodes ``coefficients[0]`` [B, H, T, D]. Windows are consecutive and
do not overlap: ``[0..w-1], [w..2w-1], ...`` (the last may be shorter). No stored state.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

from ._sketch import consecutive_windows

MODES = ("mean", "first")


@attrs.frozen
class LayerShareBasis(BasisBuilder):
    """Every layer of a window of ``window`` layers decodes the same stored vector per token."""

    head_sharding: ClassVar[str] = "head-local"

    window: int = attrs.field(default=2, validator=integer(1), metadata={"doc": "consecutive layers sharing one stored vector per token (the last window may be shorter)"})
    mode: str = attrs.field(default="mean", validator=choice(MODES), metadata={"doc": "'mean': the average of the window's layers (MiniCache-like); 'first': the first layer's vector (KVSharer-like reuse)"})

    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        return consecutive_windows(shape.num_layers, self.window)

    def coefficient_width(self, shape: ModelShape) -> int:
        return shape.head_dim

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5:
            raise ValueError(f"layer-share expects x shaped [G, B, H, n, D], got {tuple(x.shape)}")
        if self.mode == "mean":
            return x.mean(dim=0, keepdim=True)
        return x[:1]

    def coefficient_rows(self, group_size: int) -> int:
        return 1

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        return coefficients[0]


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("layer-share", LayerShareBasis)
