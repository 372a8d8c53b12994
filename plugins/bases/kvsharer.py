"""``kvsharer``: layer-wise sharing between dissimilar layers; sharing layers store nothing of their own.

KVSharer (Yang et al., 2024, "KVSharer: Efficient Inference via Layer-Wise Dissimilar KV Cache Sharing",
arXiv:2410.18517): counter-intuitively, letting a layer reuse the KV cache of a *dissimilar* layer hurts
less than reusing a similar one. KVSharer ranks layer pairs by the Euclidean distance between their
average KV caches on calibration data, most dissimilar first, and walks down that list replacing one
layer's cache with the other's until the wanted number of layers share.

Here:

- One group holds every layer (the whole model is encoded together once every layer has the block).
- Calibration: the group's first compressed block (the prompt, when it is compressed in one flush):
  per layer, the mean vector over the block's tokens, flattened over the KV heads and averaged over the
  batch; pairs ``(i, j)`` sorted by ``||mean_i - mean_j||`` descending. Walking that list, the later
  layer ``j`` of a pair reuses ``i`` when ``j`` neither shares nor is reused yet and ``i`` does not share
  (so a source always stores its own vectors), until ``share_layers`` layers share (or, with
  ``share_layers = -1``, ``round(share_fraction * L)``: KVSharer states its compression as a fraction of
  the layers). Keys and values are
  calibrated separately (each has its own state), so a layer may share its keys but not its values.
  KVSharer's check of the model's output on calibration data is not done (there is no output here).
- Coefficients: the non-sharing layers' vectors [L - share_layers, B, H, n, D], packed by the
  ``quantizer`` slot; a sharing layer adds no bytes and decodes its source's vectors.
- State (batch on dim 0): ``row`` int32 [B, L], the coefficient row each layer decodes (its own, or its
  source's).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import integer, number


def dissimilar_pairs(means: torch.Tensor, share_layers: int) -> dict[int, int]:
    """``{sharing layer: source layer}`` from per-layer mean vectors ``means`` [L, C], most distant pairs first."""
    layers = means.shape[0]
    distance = torch.cdist(means.double()[None], means.double()[None])[0]
    pairs = sorted(((float(distance[i, j]), i, j) for i in range(layers) for j in range(i + 1, layers)), key=lambda p: (-p[0], p[1], p[2]))
    source_of: dict[int, int] = {}
    sources: set[int] = set()
    for _, i, j in pairs:
        if len(source_of) >= share_layers:
            break
        if j in source_of or j in sources or i in source_of:
            continue
        source_of[j] = i
        sources.add(i)
    return source_of


@attrs.frozen
class KVSharerBasis(BasisBuilder):
    """``share_layers`` layers reuse the stored K/V of the layer most dissimilar to them (calibrated once)."""

    head_sharding: ClassVar[str] = (
        "which layers share is calibrated on mean vectors taken over all KV "
        "heads together, so each rank would pair different layers"
    )

    share_layers: int = attrs.field(default=-1, validator=integer(-1), metadata={"doc": "layers that store nothing and reuse another layer's K/V (-1: share_fraction of the layers)"})
    share_fraction: float = attrs.field(default=0.25, validator=number(0.0, 0.5), metadata={"doc": "fraction of the layers that share, when share_layers = -1"})

    def sharing(self, num_layers: int) -> int:
        """How many of ``num_layers`` layers share."""
        return self.share_layers if self.share_layers >= 0 else round(self.share_fraction * num_layers)

    def check_model(self, shape: ModelShape) -> None:
        if self.sharing(shape.num_layers) > shape.num_layers // 2:
            raise ModelError(
                f"kvsharer: {self.sharing(shape.num_layers)} sharing layers (share_layers {self.share_layers}, share_fraction "
                f"{self.share_fraction}) exceed half of the model's {shape.num_layers} layers "
                f"(every sharing layer needs its own source); use share_layers <= {shape.num_layers // 2}"
            )

    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        return [tuple(range(shape.num_layers))]

    def coefficient_width(self, shape: ModelShape) -> int:
        return shape.head_dim

    def coefficient_rows(self, group_size: int) -> int:
        return group_size - self.sharing(group_size)

    def init_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        layers, batch = x.shape[0], x.shape[1]
        means = x.float().mean(dim=3).mean(dim=1).reshape(layers, -1)  # [L, H*D]
        wanted = self.sharing(layers)
        source_of = dissimilar_pairs(means, wanted)
        if len(source_of) < wanted:
            raise CacheStateError(f"kvsharer: only {len(source_of)} of {wanted} sharing layers could be paired")
        stored = [layer for layer in range(layers) if layer not in source_of]
        row_of = {layer: index for index, layer in enumerate(stored)}
        rows = [row_of[source_of.get(layer, layer)] for layer in range(layers)]
        return {"row": torch.tensor(rows, dtype=torch.int32, device=x.device).expand(batch, -1).contiguous()}

    def stored_layers(self, state: dict[str, torch.Tensor]) -> list[int]:
        rows = state["row"][0].tolist()
        return [layer for layer, row in enumerate(rows) if rows.index(row) == layer]

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != state["row"].shape[1]:
            raise CacheStateError(f"kvsharer: block has {x.shape[0]} layers, the calibration {state['row'].shape[1]}")
        return x.float()[self.stored_layers(state)]

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        return coefficients[int(state["row"][0, member])]


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("kvsharer", KVSharerBasis)
