"""Routed residuals: for tokens a router gives rank ``rho > 0``, either the ``rho`` channels with the
largest error after the packed coefficients (``residual_mode = "channels"``), or the first ``rho``
coordinates of that error on a per-layer residual basis (``"basis"``), stored as a flat list per level.

One :class:`ResidualList` per layer and level holds ``N`` entries::

    row    int32 [N]        b * H + h of the entry
    token  int32 [N]        the token's index among the layer's packed tokens
    index  uint8 [N, rho]   channels corrected (head_dim <= 256; "channels" mode with rho < head_dim only)
    q_*    the values, packed by the residual quantizer [N, ...]

so tokens at rank 0 cost nothing, and every byte counted is a byte held. A full-rank entry (rho =
head_dim) in "channels" mode stores the whole vector with no channel indices (they would only list
0..D-1).

Residual rows: by default the residual of a layer is what that layer's decode misses, stored in that
layer's lists. A basis may instead declare a mixing matrix ``M`` [G, G] (``residual_mixing``, e.g. the
inverse DCT of ``dct-depth``): the group's misses ``E`` [G, ...] are turned into rows ``R = M^-1 E``
(row ``k`` stored in the lists of the group's ``k``-th layer), and layer ``m`` adds ``sum_k M[m, k] R_k``
(:func:`residual_rows`, :func:`mix_residuals`). The router's ranks then index rows, not layers.
"""

from __future__ import annotations

import torch

from kvweave.core.interfaces import Quantizer
from kvweave.core.linalg import top_eigenvectors
from kvweave.core.storage import TensorMap, tensor_bytes

TILE_TOKENS = 32  # tokens per tile of the residual tile index (one bit each in an int32 mask)


class ResidualList:
    """The residual entries of one layer at one rank level."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fields: TensorMap = {}
        # kernels' tile index (built on demand by tile_index, counted in nbytes): per (row, 32-token tile)
        # the first entry and a bit mask of the tokens that have one
        self.tile_start: torch.Tensor | None = None  # int32 [rows, tiles]
        self.tile_mask: torch.Tensor | None = None  # int32 [rows, tiles]
        self._indexed_entries = 0

    @property
    def entries(self) -> int:
        return 0 if not self.fields else self.fields["row"].shape[0]

    def append(self, fields: TensorMap) -> None:
        if not self.fields:
            self.fields = dict(fields)
        else:
            self.fields = {name: torch.cat((self.fields[name], fields[name]), dim=0) for name in self.fields}

    def nbytes(self) -> int:
        index = [t for t in (self.tile_start, self.tile_mask) if t is not None]
        return tensor_bytes([*self.fields.values(), *index])

    def tile_index(self, rows: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the entries of every (row, 32-token tile) are, for ``tiles`` tiles: the index of its first
        entry (int32 [rows, tiles]) and a bit mask of its tokens that have one (int32 [rows, tiles], bit
        ``i`` for token ``32 * tile + i``), so a kernel finds token ``t``'s entry at ``start + popcount(mask &
        (2^i - 1))`` without searching. Entries of one (row, tile) must be contiguous and sorted by token:
        true of blocks appended in token order, each sorted by row then token (as the engine appends
        them), and after ``select_batch``. Extended incrementally: only entries appended since the last
        call are indexed."""
        known = 0 if self.tile_start is None else self.tile_start.shape[1]
        if known == tiles and self._indexed_entries == self.entries:
            return self.tile_start, self.tile_mask  # type: ignore[return-value]
        if known > tiles:
            raise ValueError(f"residual tile index covers {known} tiles, asked for {tiles}")
        new = tiles - known
        first = self._indexed_entries
        start = torch.zeros(rows * new, dtype=torch.int32, device=device)
        bits = torch.zeros(rows * new, dtype=torch.int64, device=device)
        if self.entries > first:
            row = self.fields["row"][first:].long()
            token = self.fields["token"][first:].long()
            key = row * new + token // TILE_TOKENS - known
            order = torch.arange(first, self.entries, device=device, dtype=torch.int32)
            bits.index_add_(0, key, torch.ones_like(key) << (token % TILE_TOKENS))  # distinct bits: the sum is the OR
            start.fill_(torch.iinfo(torch.int32).max).scatter_reduce_(0, key, order, reduce="amin", include_self=True)
            start = torch.where(bits > 0, start, 0)
        mask = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # the 32 bits, as int32
        start, mask = start.view(rows, new), mask.view(rows, new)
        if self.tile_start is None:
            self.tile_start, self.tile_mask = start, mask
        else:
            self.tile_start = torch.cat((self.tile_start, start), dim=1)
            self.tile_mask = torch.cat((self.tile_mask, mask), dim=1)
        self._indexed_entries = self.entries
        return self.tile_start, self.tile_mask

    def select_batch(self, index: torch.Tensor, heads: int) -> None:
        """Keep the entries of batch rows ``index`` [B'] (repeats allowed), renumbered 0..B'-1."""
        self.tile_start = self.tile_mask = None  # rebuilt on demand for the new rows (also for a list without entries)
        self._indexed_entries = 0
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


def fit_residual_basis(missing: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-head orthonormal residual basis [..., rank, D] (float16) for residuals ``missing`` [..., n, D]:
    the top right singular vectors of the block, found as the top eigenvectors of its ``D x D`` second
    moment ``missing^T missing`` (the prompt's block can hold tens of thousands of tokens): ``eigh`` on a
    CPU; on a GPU, which runs ``eigh`` of a 128 x 128 matrix one matrix at a time, batched subspace
    iteration (:func:`kvweave.core.linalg.top_eigenvectors`), or ``eigh`` when that breaks down or D <= 32."""
    if missing.dim() < 3:
        raise ValueError(f"residuals must be [..., n, D] with at least one leading dimension, got {tuple(missing.shape)}")
    # [..., D, D], one leading index at a time: a prompt's block in float32 would be several GB at once
    moment = torch.stack([part.float().transpose(-1, -2) @ part.float() for part in missing])
    found = top_eigenvectors(moment, rank) if moment.is_cuda and moment.shape[-1] > 32 else None
    if found is not None:
        return found[0].to(torch.float16).contiguous()
    _, vectors = torch.linalg.eigh(moment)  # ascending eigenvalues; columns are eigenvectors
    basis = vectors.flip(-1)[..., :rank].transpose(-1, -2)  # [..., rank, D], largest first
    return basis.to(torch.float16).contiguous()


def _fixed_choice(runs: tuple[tuple[int, int, int], ...], rank: int, rows: int, tokens: int, device: torch.device) -> torch.Tensor:
    """The flat indices [rows x tokens] of the tokens the ``runs`` give ``rank``, in every row, in order: built from
    ranges of positions on the device (nothing read from or sent by the host)."""
    parts = [torch.arange(start, stop, device=device) for start, stop, level in runs if level == rank]
    columns = parts[0] if len(parts) == 1 else torch.cat(parts)
    return (torch.arange(rows, device=device).unsqueeze(1) * tokens + columns).reshape(-1)


def encode_residuals(
    missing: torch.Tensor, ranks: torch.Tensor | tuple[tuple[int, int, int], ...], quantizer: Quantizer,
    basis: torch.Tensor | None = None,
) -> dict[int, TensorMap]:
    """The residual entries of one block, by rank level: ``missing`` [B, H, n, D] (x minus its
    reconstruction), ``ranks`` [B, H, n], or fixed ranks known on the host, the same in every row and head: runs
    ``(start, stop, rank)`` of the block's tokens, ascending and apart, every other token at rank 0 (no host read).
    Token indices are relative to the block.

    Without ``basis``: the ``rho`` largest channels, with their indices. With ``basis`` [B, H, R, D]
    (a per-layer residual basis): the first ``rho`` coordinates on it, no indices needed."""
    batch, heads, tokens, dim = missing.shape
    if basis is not None:
        coordinates = torch.einsum("bhnd,bhkd->bhnk", missing.float(), basis.float())
        flat_coordinates = coordinates.reshape(batch * heads * tokens, -1)
    flat_missing = missing.reshape(-1, dim)
    fixed = not isinstance(ranks, torch.Tensor)
    if fixed and any(not 0 <= start < stop <= tokens for start, stop, _ in ranks):
        raise ValueError(f"encode_residuals: fixed runs {ranks} reach outside a block of {tokens} tokens")
    flat_ranks = None if fixed else ranks.reshape(-1)
    entries: dict[int, TensorMap] = {}
    for rank in sorted({level for _, _, level in ranks}) if fixed else torch.unique(flat_ranks).tolist():
        if rank == 0:
            continue
        if fixed:
            chosen = _fixed_choice(ranks, rank, batch * heads, tokens, missing.device)
        else:
            chosen = (flat_ranks == rank).nonzero().squeeze(1)
        fields = {"row": (chosen // tokens).to(torch.int32), "token": (chosen % tokens).to(torch.int32)}
        if basis is None and rank >= dim:  # full rank: the whole vector, no channel indices
            values = flat_missing.index_select(0, chosen)
        elif basis is None:
            picked = flat_missing.index_select(0, chosen)
            top = picked.abs().topk(rank, dim=-1).indices
            fields["index"] = top.to(torch.uint8)
            values = picked.gather(-1, top)
        else:
            values = flat_coordinates.index_select(0, chosen)[:, :rank].to(missing.dtype)
        fields.update({f"q_{name}": t for name, t in quantizer.quantize(values).items()})
        entries[rank] = fields
    return entries


def add_residuals(
    vectors: torch.Tensor, lists: dict[int, TensorMap], quantizer: Quantizer, gates: torch.Tensor | None = None,
    basis: torch.Tensor | None = None, weight: float = 1.0,
) -> torch.Tensor:
    """``vectors`` [B, H, T, D] plus ``weight`` times the residual entries ``lists`` (rank -> fields), each
    value scaled by its head's gate (``gates`` [H] in [0, 1]; None = 1), on channels or on ``basis``
    [B, H, R, D] as they were encoded. Returns a new tensor."""
    batch, heads, tokens, dim = vectors.shape
    out = vectors.clone()
    flat = out.view(-1, dim)
    for rank, fields in lists.items():
        if not fields or fields["row"].numel() == 0:
            continue
        packed = {name[2:]: tensor for name, tensor in fields.items() if name.startswith("q_")}
        values = quantizer.dequantize(packed, vectors.dtype)
        rows = fields["row"].long()
        if gates is not None:
            values = values * gates.to(vectors.dtype)[rows % heads].unsqueeze(-1)
        if weight != 1.0:
            values = values * weight
        if basis is None and "index" not in fields:  # a full-rank entry
            delta = values
        elif basis is None:
            delta = torch.zeros(values.shape[0], dim, dtype=vectors.dtype, device=vectors.device)
            delta.scatter_(1, fields["index"].long(), values)
        else:
            directions = basis.reshape(batch * heads, -1, dim)[rows, :rank, :].to(vectors.dtype)  # [N, rank, D]
            delta = torch.einsum("nk,nkd->nd", values, directions)
        flat.index_add_(0, rows * tokens + fields["token"].long(), delta)
    return out


def entry_bytes(rank: int, quantizer: Quantizer, with_indices: bool = True) -> float:
    """Stored bytes of one residual entry at ``rank``: row and token (int32), channel indices (uint8,
    unless on a residual basis or at full rank; pass ``with_indices=False`` then), packed values."""
    return 4 + 4 + (rank if with_indices else 0) + quantizer.bytes_per_vector(rank, torch.float32)


def residual_rows(missing: torch.Tensor, mixing: torch.Tensor | None) -> torch.Tensor:
    """The rows to store for a group's misses ``missing`` [G, B, H, n, D]: ``M^-1 missing`` along the group
    axis for a mixing matrix ``mixing`` [G, G], or ``missing`` itself when ``mixing`` is None."""
    if mixing is None:
        return missing
    if mixing.shape != (missing.shape[0], missing.shape[0]):
        raise ValueError(f"residual mixing matrix {tuple(mixing.shape)} does not match a group of {missing.shape[0]} layers")
    analysis = torch.linalg.inv(mixing.double()).to(torch.float32).to(missing.device)
    return torch.einsum("kg,g...->k...", analysis, missing.float()).to(missing.dtype)


def mix_residuals(
    vectors: torch.Tensor, member: int, lists: list[dict[int, TensorMap]], quantizer: Quantizer,
    mixing: torch.Tensor, gates: list[torch.Tensor | None] | None = None,
    bases: list[torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Layer ``member``'s ``vectors`` [B, H, T, D] plus ``sum_k mixing[member, k] R_k``, where ``R_k`` are the
    residual rows in ``lists[k]`` (the lists of the group's ``k``-th layer, rank -> fields)."""
    out = vectors
    for k, rows in enumerate(lists):
        weight = float(mixing[member, k])
        if weight == 0.0 or not any(f and f["row"].numel() for f in rows.values()):
            continue
        out = add_residuals(out, rows, quantizer, None if gates is None else gates[k], None if bases is None else bases[k], weight)
    return out if out is not vectors else vectors.clone()
