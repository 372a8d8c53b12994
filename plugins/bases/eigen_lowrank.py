"""``eigen-lowrank``: per-layer, per-head low-rank projection of K and V, in the spirit of Eigen Attention.

Eigen Attention (Saxena et al., 2024, "Eigen Attention: Attention in Low-Rank Space for KV Cache
Compression", arXiv:2408.05646): keys and values are projected onto the leading eigenvectors of their
second-moment matrix, found once from calibration data, so the cache holds ``r < D`` coordinates per
token.

Here the calibration is the first compressed block of each layer (the prompt, when it is compressed in
one flush): per layer, KV head and batch row, the top ``rank`` right singular vectors of the block's
vectors ``X`` [n, D] (the eigenvectors of ``X^T X``) form the basis ``P`` [rank, D]. Every token is
stored as ``x P^T`` (``rank`` coefficients, packed by the ``quantizer`` slot) and decoded as ``c P``. The
basis is fixed after the first block. Eigen Attention's per-layer rank from an energy threshold is not
offered: the engine's coefficient width is one number for all layers.

State (batch on dim 0): ``basis`` [B, H, rank, D] in ``basis_dtype`` (float16 by default).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import DtypeTable, torch
from kvweave.core.params import choice, integer

DTYPES = DtypeTable("float16", "float32")


@attrs.frozen
class EigenLowRankBasis(BasisBuilder):
    """A fixed rank-``rank`` eigenbasis per layer and head, from the first compressed block."""

    head_sharding: ClassVar[str] = "head-local"

    rank: int = attrs.field(default=32, validator=integer(1, 4096), metadata={"doc": "coefficients per token (<= head_dim)"})
    basis_dtype: str = attrs.field(default="float16", validator=choice(DTYPES), metadata={"doc": "dtype of the stored basis"})

    def check_model(self, shape: ModelShape) -> None:
        if self.rank > shape.head_dim:
            raise ModelError(f"eigen-lowrank: rank {self.rank} exceeds the model's head_dim {shape.head_dim}; use rank <= {shape.head_dim}")

    def coefficient_width(self, shape: ModelShape) -> int:
        return self.rank

    def init_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.shape[0] != 1:
            raise CacheStateError(f"eigen-lowrank: groups are single layers, got {x.shape[0]}")
        if self.rank > x.shape[-1]:
            raise ModelError(f"eigen-lowrank: rank {self.rank} exceeds head_dim {x.shape[-1]}")
        # full_matrices: an orthonormal basis of R^D even when the block has fewer tokens than the rank
        _, _, right = torch.linalg.svd(x[0].double(), full_matrices=True)
        return {"basis": right[..., : self.rank, :].to(DTYPES[self.basis_dtype]).contiguous()}

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return (x[0].float() @ state["basis"].float().transpose(-1, -2)).unsqueeze(0)

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        return (coefficients[0].float() @ state["basis"].float()).to(coefficients.dtype)


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("eigen-lowrank", EigenLowRankBasis)
