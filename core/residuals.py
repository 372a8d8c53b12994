"""Routed residuals: for tokens a router gives rank ``rho > 0``, the ``rho`` channels with the largest
error after the packed coefficients, stored as a flat list per rank level.

One :class:`ResidualList` per layer and level holds ``N`` entries::

    row    int32 [N]        b * H + h of the entry
    token  int32 [N]        the token's index among the layer's packed tokens
    index  uint8 [N, rho]   channels corrected (head_dim <= 256)
    q_*    the values, packed by the residual quantizer [N, ...]

so tokens at rank 0 cost nothing, and every byte counted is a byte held.
"""

from __future__ import annotations

import torch

from .interfaces import Quantizer
from .storage import TensorMap, tensor_bytes


class ResidualList:
    """The residual entries of one layer at one rank level."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fields: TensorMap = {}

    @property
    def entries(self) -> int:
        return 0 if not self.fields else self.fields["row"].shape[0]

    def append(self, fields: TensorMap) -> None:
        if not self.fields:
            self.fields = dict(fields)
        else:
            self.fields = {name: torch.cat((self.fields[name], fields[name]), dim=0) for name in self.fields}

    def nbytes(self) -> int:
        return tensor_bytes(self.fields.values())

    def select_batch(self, index: torch.Tensor, heads: int) -> None:
        """Keep the entries of batch rows ``index`` [B'] (repeats allowed), renumbered 0..B'-1."""
        if not self.fields:
            return
        batch_of = self.fields["row"] // heads
        head_of = self.fields["row"] % heads
        parts: list[TensorMap] = []
        for new_b, old_b in enumerate(index.tolist()):
            chosen = (batch_of == old_b).nonzero().squeeze(1)
            part = {name: tensor.index_select(0, chosen) for name, tensor in self.fields.items()}
            part["row"] = (head_of.index_select(0, chosen) + new_b * heads).to(torch.int32)
            parts.append(part)
        self.fields = {name: torch.cat([part[name] for part in parts], dim=0) for name in self.fields}


def encode_residuals(missing: torch.Tensor, ranks: torch.Tensor, quantizer: Quantizer) -> dict[int, TensorMap]:
    """The residual entries of one block, by rank level: ``missing`` [B, H, n, D] (x minus its
    reconstruction), ``ranks`` [B, H, n]. Token indices are relative to the block."""
    batch, heads, tokens, dim = missing.shape
    flat_missing = missing.reshape(-1, dim)
    flat_ranks = ranks.reshape(-1)
    entries: dict[int, TensorMap] = {}
    for rank in torch.unique(flat_ranks).tolist():
        if rank == 0:
            continue
        chosen = (flat_ranks == rank).nonzero().squeeze(1)
        picked = flat_missing.index_select(0, chosen)
        top = picked.abs().topk(rank, dim=-1).indices
        fields = {"row": (chosen // tokens).to(torch.int32), "token": (chosen % tokens).to(torch.int32), "index": top.to(torch.uint8)}
        fields.update({f"q_{name}": t for name, t in quantizer.quantize(picked.gather(-1, top)).items()})
        entries[rank] = fields
    return entries


def add_residuals(
    vectors: torch.Tensor, lists: dict[int, TensorMap], quantizer: Quantizer, gates: torch.Tensor | None = None
) -> torch.Tensor:
    """``vectors`` [B, H, T, D] plus the residual entries ``lists`` (rank -> fields), each value scaled by
    its head's gate (``gates`` [H] in [0, 1]; None = 1). Returns a new tensor."""
    batch, heads, tokens, dim = vectors.shape
    out = vectors.clone()
    flat = out.view(-1, dim)
    for fields in lists.values():
        if not fields or fields["row"].numel() == 0:
            continue
        packed = {name[2:]: tensor for name, tensor in fields.items() if name.startswith("q_")}
        values = quantizer.dequantize(packed, vectors.dtype)
        if gates is not None:
            values = values * gates.to(vectors.dtype)[(fields["row"] % heads).long()].unsqueeze(-1)
        delta = torch.zeros(values.shape[0], dim, dtype=vectors.dtype, device=vectors.device)
        delta.scatter_(1, fields["index"].long(), values)
        position = fields["row"].long() * tokens + fields["token"].long()
        flat.index_add_(0, position, delta)
    return out


def entry_bytes(rank: int, quantizer: Quantizer) -> float:
    """Stored bytes of one residual entry at ``rank``: row and token (int32), indices, packed values."""
    return 4 + 4 + rank + quantizer.bytes_per_vector(rank, torch.float32)
