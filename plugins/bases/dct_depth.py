"""``dct-depth``: FreqDepthKV's depth-frequency factorization, an orthonormal DCT along depth per block of layers.

FreqDepthKV ("FreqDepthKV: frequency-guided depth sharing for robust KV cache compression", seeds/002,
Section 3, Eqs. (1) and (3)): the K (or V) vectors of a block of ``G`` adjacent layers are stacked along
depth, ``X`` [G, T, D] per head, and transformed by an orthonormal DCT-II ``F`` [G, G]:
``Z = F X``, ``X = F^T Z``. The first (DC, lowest-frequency) coefficient ``Z_0`` is the shared-depth
component, stored once per block for every token; the high-frequency coefficients ``Z_1 .. Z_{G-1}``
are stored only for the token-head pairs the router selects.

How that maps onto the engine:

- Coefficients: the DC coefficient in layer units, ``F[0, m] Z_0 = Z_0 / sqrt(G)`` [1, B, H, n, D]
  (``S = 1``, ``r = D``; the same for every member ``m``, so decoding needs no ``G``), packed by the
  ``quantizer`` slot. The DC term alone is the mean of the block's layers, and every layer decodes it.
- High frequencies: ``residual_mixing(G) = F^T``. The engine turns the block's misses ``X - F^T [Z_0; 0]``
  into rows ``F (X - x_hat)``: row 0 is the DC coefficient's quantization error, rows ``k >= 1`` are
  exactly ``Z_k``. Row ``k`` of a token is stored in the residual lists of the block's ``k``-th layer, and
  layer ``m`` adds ``sum_k F[k, m] Z_k`` of the stored rows: Eq. (3),
  ``X~ = F^T [Z_0 ; 1_{t in S} Z_{1:G-1}]``. A token with all its high-frequency rows restores every
  layer of the block (up to the DC quantization and the residual quantizer); the ``head-mode`` router
  picks the rows.
- Blocks (``layer_groups``): the first and the last ``edge_layers`` layers in blocks of ``edge_block``,
  the layers between in blocks of ``block`` (the paper's default: 4 in the middle, 2 for the first and
  last four layers). A middle remainder of 2 or more layers makes one shorter last block; a remainder of
  one layer (which would share nothing) is refused, as is an ``edge_block`` that does not divide
  ``edge_layers``. In a model of at most ``2 * edge_layers`` layers every layer is among the first or
  the last ``edge_layers``, so the whole model is blocked by ``edge_block`` (the rule read literally);
  a last layer left alone is refused there too.

``mode = "average"`` (the ablation "adjacent-layer averaging instead of DCT"): the block's mean is
stored, and there is no frequency split: a selected token's residual is every layer's own deviation
from the mean (``G`` rows instead of the DCT's ``G - 1``, which is what the DCT saves). The DC-only
reconstruction is the same in both modes (the DC term of an orthonormal DCT is the scaled mean).

No stored state: ``F`` is a fixed function of ``G``.
"""

from __future__ import annotations

from typing import ClassVar

import math

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

MODES = ("dct", "average")


def dct_matrix(size: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix ``F`` [size, size] (float64): ``F[k, l] = a_k cos(pi (2l + 1) k / (2 size))``,
    ``a_0 = sqrt(1/size)``, ``a_k = sqrt(2/size)``; ``F F^T = I``."""
    if size < 1:
        raise ValueError(f"a DCT needs at least one point, got {size}")
    k = torch.arange(size, dtype=torch.float64)[:, None]
    l = torch.arange(size, dtype=torch.float64)[None, :]
    matrix = torch.cos(math.pi * (2 * l + 1) * k / (2 * size)) * math.sqrt(2.0 / size)
    matrix[0] = math.sqrt(1.0 / size)
    return matrix


def depth_blocks(num_layers: int, block: int, edge_block: int, edge_layers: int, where: str = "dct-depth") -> list[tuple[int, ...]]:
    """Consecutive blocks: ``edge_layers`` layers at each end in blocks of ``edge_block``, the middle in blocks
    of ``block`` (a last shorter middle block of >= 2 layers allowed). Raises :class:`ModelError` otherwise."""
    if edge_layers and edge_layers % edge_block != 0:
        raise ModelError(
            f"{where}: edge_block {edge_block} does not divide edge_layers {edge_layers}; use an edge_block that divides it"
        )
    if 2 * edge_layers >= num_layers:  # every layer is among the first or the last edge_layers
        if num_layers % edge_block == 1 and edge_block > 1:
            raise ModelError(
                f"{where}: the model's {num_layers} layers all lie within the first or last edge_layers {edge_layers}; "
                f"blocks of edge_block {edge_block} leave one layer over, a block that would share nothing; "
                f"use an edge_block with {num_layers} % edge_block != 1"
            )
        return [tuple(range(start, min(start + edge_block, num_layers))) for start in range(0, num_layers, edge_block)]
    middle = num_layers - 2 * edge_layers
    remainder = middle % block
    if remainder == 1 and block > 1:
        raise ModelError(
            f"{where}: the {middle} layers between the edges ({edge_layers}..{num_layers - edge_layers - 1}) leave one layer "
            f"over after blocks of {block}, a block that would share nothing; choose block so that {middle} % block != 1 "
            f"(e.g. {', '.join(str(b) for b in range(2, 9) if middle % b != 1)}) or change edge_layers"
        )
    starts = list(range(0, edge_layers, edge_block))
    starts += list(range(edge_layers, num_layers - edge_layers, block))
    starts += list(range(num_layers - edge_layers, num_layers, edge_block))
    bounds = starts + [num_layers]
    groups = []
    for start, stop in zip(bounds[:-1], bounds[1:]):
        size = block if edge_layers <= start < num_layers - edge_layers else edge_block
        groups.append(tuple(range(start, min(stop, start + size))))
    return groups


@attrs.frozen
class DctDepthBasis(BasisBuilder):
    """DC of an orthonormal depth DCT per block of layers (shared); high frequencies as routed residual rows."""

    head_sharding: ClassVar[str] = "head-local"

    block: int = attrs.field(default=4, validator=integer(1, 64), metadata={"doc": "B, layers per block between the edges"})
    edge_block: int = attrs.field(default=2, validator=integer(1, 64), metadata={"doc": "layers per block within the first and last edge_layers layers"})
    edge_layers: int = attrs.field(default=4, validator=integer(0, 1024), metadata={"doc": "layers at each end of the model blocked by edge_block (0: none)"})
    mode: str = attrs.field(default="dct", validator=choice(MODES), metadata={"doc": "'dct': DC shared, high frequencies as residual rows; 'average': the layers' mean shared, per-layer deviations as residual rows (ablation)"})

    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        return depth_blocks(shape.num_layers, self.block, self.edge_block, self.edge_layers)

    def check_model(self, shape: ModelShape) -> None:
        self.layer_groups(shape)

    def coefficient_width(self, shape: ModelShape) -> int:
        return shape.head_dim

    def coefficient_rows(self, group_size: int) -> int:
        return 1

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5:
            raise ValueError(f"dct-depth expects x shaped [G, B, H, n, D], got {tuple(x.shape)}")
        # F[0, m] Z_0 = (1/sqrt(G)) sum_l (1/sqrt(G)) x_l: the DC term in layer units is the layers' mean
        return x.float().mean(dim=0, keepdim=True)

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        if coefficients.shape[0] != 1:
            raise CacheStateError(f"dct-depth: expected one shared coefficient row, got {coefficients.shape[0]}")
        return coefficients[0]

    def residual_mixing(self, group_size: int) -> torch.Tensor | None:
        if self.mode == "average":
            return None
        return dct_matrix(group_size).T.to(torch.float32).contiguous()


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("dct-depth", DctDepthBasis)
