"""Routed residuals: for tokens a router gives rank ``rho > 0``, either the ``rho`` channels with the
largest error after the packed coefficients (``residual_mode = "channels"``), or the first ``rho``
coordinates of that error on a per-layer residual basis (``"basis"``), stored as a flat list per level.

One :class:`ResidualList` per layer and level holds ``N`` entries and where they are::

    bits     int32 [B * H, words]  bit ``t % 32`` of word ``t // 32`` set where packed token ``t`` of row
                                   ``b * H + h`` has an entry at this level (1 bit a token and row)
    chunks   int32 [C]             the first packed token of each block the list was appended
    index    uint8 [N, rho]        channels corrected (head_dim <= 256; "channels" mode with rho < head_dim only)
    q_*      the values, packed by the residual quantizer [N, ...]

Entries are held block by block in the order they were appended, each block's sorted by row, then token,
so the bits and the block starts say which (row, token) every entry is (:meth:`ResidualList.located`) and
no entry stores its row or token (an int32 pair would take 8 bytes, more than a rank-8 entry's values).
Tokens at rank 0 cost their bit, and every byte counted is a byte held. A full-rank entry (rho =
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

from kvweave.core.host_to_device import on_device
from kvweave.core.interfaces import Quantizer
from kvweave.core.linalg import rayleigh_ritz, subspace_iteration, tall_product
from kvweave.core.storage import TensorMap, tensor_bytes

TILE_TOKENS = 32  # tokens per word of a list's bits, and per tile of the kernels' tile index

#: the fields that say where an entry is, as :func:`encode_residuals` returns them and :meth:`ResidualList.located`
#: derives them: held as the list's bits, never stored
LOCATION = ("row", "token")


def _first_entries(at: torch.Tensor, first: int, size: int) -> torch.Tensor:
    """int32 [size]: for each of ``size`` tiles, the index of its first entry, -1 where it has none; ``at`` names the
    tile of each entry held from index ``first`` on, in the order held."""
    none = torch.iinfo(torch.int32).max
    order = torch.arange(first, first + at.numel(), device=at.device, dtype=torch.int32)
    found = torch.full((size,), none, dtype=torch.int32, device=at.device).scatter_reduce_(0, at, order, reduce="amin")
    return torch.where(found < none, found, -1)


class ResidualList:
    """The residual entries of one layer at one rank level (the module's docstring gives the layout).

    With ``tiles`` (a kernel that reads the entries in place) it also keeps the kernels' tile index: per (row,
    32-token tile) the index of the tile's first entry (``tile_start``, int32 [rows, tiles], counted in
    :meth:`nbytes`), extended as blocks are appended; the tile's bit mask is the word of :attr:`bits` (what
    :meth:`tile_index` returns)."""

    def __init__(self, rank: int, tiles: bool = False) -> None:
        self.rank = rank
        self.tiles = tiles
        self.fields: TensorMap = {}  # the entries' values (and channel indices): what :data:`LOCATION` leaves
        self.bits: torch.Tensor | None = None  # int32 [rows, words]
        self.chunks: torch.Tensor | None = None  # int32 [C]: each appended block's first packed token
        self.tile_start: torch.Tensor | None = None  # int32 [rows, tiles] (tiles, or built by tile_index)

    @property
    def entries(self) -> int:
        return 0 if not self.fields else next(iter(self.fields.values())).shape[0]

    def extend(self, rows: int, tokens: int, device: torch.device) -> None:
        """Cover packed tokens ``0 .. tokens`` of ``rows`` rows with bits (zeros for tokens without entries) and, with
        ``tiles``, the tile index (``tokens`` a multiple of 32 then)."""
        words = -(-tokens // TILE_TOKENS)
        if self.bits is None:
            self.bits = torch.zeros(rows, words, dtype=torch.int32, device=device)
        held = self.bits.shape[1]
        if self.bits.shape[0] != rows:
            raise ValueError(f"residual list of rank {self.rank} holds {self.bits.shape[0]} rows, asked for {rows}")
        if words > held:
            self.bits = torch.cat((self.bits, torch.zeros(rows, words - held, dtype=torch.int32, device=device)), dim=1)
        if self.tiles:
            if tokens % TILE_TOKENS:
                raise ValueError(f"a residual tile index covers whole tiles of {TILE_TOKENS} tokens; asked for {tokens}")
            started = 0 if self.tile_start is None else self.tile_start.shape[1]
            if words > started:
                more = torch.zeros(rows, words - started, dtype=torch.int32, device=device)
                self.tile_start = more if self.tile_start is None else torch.cat((self.tile_start, more), dim=1)

    def append(self, fields: TensorMap, first: int, tokens: int, rows: int, last: int | None = None) -> None:
        """Append one block's entries: ``fields`` as :func:`encode_residuals` gives them (``row``, ``token`` [N] with
        ``token`` the packed-token index, sorted by row, then token), the block's packed tokens ``first .. first +
        tokens`` of ``rows`` rows. ``row`` and ``token`` become bits; the rest is held. Without ``tiles`` the bits
        cover the tokens up to the block's last entry, ``last`` (its token index + 1) where the caller knows it, else
        read from ``token`` (a host read): a level whose entries are the first tokens (attention sinks) keeps a word a
        row, not a bit for every token after them."""
        row, token = fields["row"], fields["token"]  # int32 (int64 taken too)
        device = row.device
        if self.tiles:
            self.extend(rows, first + tokens, device)
        elif row.numel():
            self.extend(rows, last if last is not None else int(token.max()) + 1, device)
        else:
            self.extend(rows, 0, device)
        assert self.bits is not None
        words = self.bits.shape[1]
        if row.numel():
            # the block's tokens come after every earlier block's, so their bits are clear: adding a token's bit sets
            # it (bits are distinct; bit 31 wraps to int32's sign bit), and the other words stay as they are
            tile = token // TILE_TOKENS
            bit = torch.bitwise_left_shift(1, (token % TILE_TOKENS).to(torch.int32))  # int32 whatever the tokens' type
            self.bits.view(-1).index_add_(0, row * words + tile, bit)
        start = torch.full((1,), first, dtype=torch.int32, device=device)  # filled on the device: no host-to-device copy
        self.chunks = start if self.chunks is None else torch.cat((self.chunks, start))
        if self.tiles and row.numel():  # the block's tiles' first entries: its entries sit after those held
            if first % TILE_TOKENS:
                raise ValueError(f"a residual tile index needs blocks that start on a {TILE_TOKENS}-token tile; this one starts at {first}")
            assert self.tile_start is not None
            low = first // TILE_TOKENS
            span = words - low
            found = _first_entries(row.long() * span + tile - low, self.entries, rows * span).view(rows, span)
            self.tile_start[:, low:] = torch.where(found >= 0, found, self.tile_start[:, low:])
        kept = {name: t for name, t in fields.items() if name not in LOCATION}
        if not self.fields:
            self.fields = kept
        else:
            self.fields = {name: torch.cat((self.fields[name], kept[name]), dim=0) for name in self.fields}

    def located(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's row ``b * H + h`` and packed-token index (int32 [N] each, in the order the entries are held),
        from the bits and the blocks' starts: a token's block is the last one that starts at or before it, and entries
        are held by block, then row, then token. No host read (the entry count is the host's)."""
        count = self.entries
        if count == 0 or self.bits is None or self.chunks is None:
            device = None if self.bits is None else self.bits.device
            empty = torch.zeros(0, dtype=torch.int32, device=device)
            return empty, empty
        rows, words = self.bits.shape
        span = words * TILE_TOKENS
        shifts = torch.arange(TILE_TOKENS, dtype=torch.int32, device=self.bits.device)
        present = ((self.bits.unsqueeze(-1) >> shifts) & 1).view(-1).bool()  # [rows * span], row-major
        flat = torch.nonzero_static(present, size=count).squeeze(1)
        row, token = flat // span, flat % span
        block = torch.searchsorted(self.chunks.long(), token, right=True) - 1
        order = torch.argsort((block * rows + row) * span + token)
        return row[order].to(torch.int32), token[order].to(torch.int32)

    def located_fields(self) -> TensorMap:
        """The held fields with each entry's ``row`` and ``token`` (:meth:`located`): what :func:`add_residuals`
        reads."""
        if not self.fields:
            return {}
        row, token = self.located()
        return {"row": row, "token": token, **self.fields}

    def stored(self) -> list[torch.Tensor]:
        """Every tensor the list holds (what :meth:`nbytes` counts): the entries' fields, the bits, the blocks' starts
        and the tile starts."""
        return [*self.fields.values(), *(t for t in (self.bits, self.chunks, self.tile_start) if t is not None)]

    def nbytes(self) -> int:
        return tensor_bytes(self.stored())

    def tile_index(self, rows: int, tiles: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Where the entries of every (row, 32-token tile) are, for ``tiles`` tiles: the index of its first
        entry (int32 [rows, tiles]) and a bit mask of its tokens that have one (int32 [rows, tiles], bit
        ``i`` for token ``32 * tile + i``: the list's bits), so a kernel finds token ``t``'s entry at ``start +
        popcount(mask & (2^i - 1))`` without searching. Kept as blocks arrive with ``tiles``; otherwise built here
        from :meth:`located` (every block must then start on a tile). Entries of one (row, tile) are contiguous
        and sorted by token: blocks are appended in token order, each sorted by row then token."""
        self.extend(rows, tiles * TILE_TOKENS, device)
        assert self.bits is not None
        if self.bits.shape[1] != tiles:
            raise ValueError(f"residual list of rank {self.rank} covers {self.bits.shape[1]} tiles, asked for {tiles}")
        if self.tile_start is None or self.tile_start.shape[1] != tiles:
            if self.chunks is not None and bool((self.chunks % TILE_TOKENS).any()):
                raise ValueError(f"a residual tile index needs blocks that start on a {TILE_TOKENS}-token tile")
            row, token = (t.long() for t in self.located())
            self.tile_start = _first_entries(row * tiles + token // TILE_TOKENS, 0, rows * tiles).clamp_min(0).view(rows, tiles)
        return self.tile_start, self.bits

    def select_batch(self, index: torch.Tensor, heads: int) -> None:
        """Keep the entries of batch rows ``index`` [B'] (repeats allowed), renumbered 0..B'-1."""
        if self.bits is None:
            return
        span = self.bits.shape[1] * TILE_TOKENS
        if self.fields:
            row, token = (t.long() for t in self.located())
            block = torch.searchsorted(self.chunks.long(), token, right=True) - 1  # type: ignore[union-attr]
            parts, keys = [], []
            for new_b, old_b in enumerate(index.tolist()):
                chosen = (row // heads == old_b).nonzero().squeeze(1)
                new_row = row.index_select(0, chosen) % heads + new_b * heads
                parts.append(chosen)
                keys.append((block.index_select(0, chosen) * len(index) * heads + new_row) * span + token.index_select(0, chosen))
            chosen = torch.cat(parts)
            chosen = chosen.index_select(0, torch.argsort(torch.cat(keys)))  # held by block, then row, then token
            self.fields = {name: tensor.index_select(0, chosen) for name, tensor in self.fields.items()}
        rows_of = (index.to(self.bits.device).long().unsqueeze(1) * heads + torch.arange(heads, device=self.bits.device)).reshape(-1)
        self.bits = self.bits.index_select(0, rows_of)
        self.tile_start = None  # rebuilt by tile_index for the new rows
        if self.tiles and self.bits.shape[1]:
            self.tile_index(self.bits.shape[0], self.bits.shape[1], self.bits.device)


class ResidualFit:
    """A residual basis being fitted (:func:`begin_residual_fit`): the device work is queued, and :meth:`basis` reads
    whether it worked only when asked, so an encoder can queue the fit before the host read its routing makes anyway
    and ask after it (a prompt's flush then waits on the device once, not twice)."""

    def __init__(self, moment: torch.Tensor, rank: int, found: tuple[torch.Tensor, torch.Tensor] | None):
        self.moment, self.rank, self.found = moment, rank, found

    def basis(self) -> torch.Tensor:
        """The basis [..., rank, D] (float16): the subspace iteration's (its Rayleigh-Ritz step here, whose ``eigh`` waits
        for the GPU) where it worked for every matrix, else ``eigh`` of every second moment."""
        if self.found is not None and bool(self.found[1].all()):
            vectors, _ = rayleigh_ritz(self.moment, self.found[0], self.rank)
            return vectors.to(torch.float16).contiguous()
        _, vectors = torch.linalg.eigh(self.moment)  # ascending eigenvalues; columns are eigenvectors
        return vectors.flip(-1)[..., : self.rank].transpose(-1, -2).to(torch.float16).contiguous()  # largest first


def begin_residual_fit(missing: torch.Tensor, rank: int) -> ResidualFit:
    """:func:`fit_residual_basis` with nothing read by the host until :meth:`ResidualFit.basis`."""
    if missing.dim() < 3:
        raise ValueError(f"residuals must be [..., n, D] with at least one leading dimension, got {tuple(missing.shape)}")
    # [..., D, D] a leading index at a time (GBs in float32 at once), tokens in chunks on a GPU; only the iteration
    # queued here, its Rayleigh-Ritz step in ResidualFit.basis, after the routing's own host read
    moment = torch.stack([tall_product(part.float(), part.float()) for part in missing])
    found = subspace_iteration(moment, rank) if moment.is_cuda and moment.shape[-1] > 32 else None
    return ResidualFit(moment, rank, found)


def fit_residual_basis(missing: torch.Tensor, rank: int) -> torch.Tensor:
    """A per-head orthonormal residual basis [..., rank, D] (float16) for residuals ``missing`` [..., n, D]: the top
    eigenvectors of its ``D x D`` second moment, by ``eigh`` on a CPU; on a GPU (one cuSOLVER ``eigh`` a 128 x 128
    matrix) by batched subspace iteration (``kvweave.core.linalg.subspace_iteration``, ``rayleigh_ritz``), or ``eigh``
    where that breaks down or D <= 32."""
    return begin_residual_fit(missing, rank).basis()


def _fixed_choice(runs: tuple[tuple[int, int, int], ...], rank: int, rows: int, tokens: int, device: torch.device) -> torch.Tensor:
    """The flat indices [rows x tokens] of the tokens the ``runs`` give ``rank``, in every row, in order: built from
    ranges of positions on the device (nothing read from or sent by the host)."""
    parts = [torch.arange(start, stop, device=device) for start, stop, level in runs if level == rank]
    columns = parts[0] if len(parts) == 1 else torch.cat(parts)
    return (torch.arange(rows, device=device).unsqueeze(1) * tokens + columns).reshape(-1)


def encode_residuals(
    missing: torch.Tensor, ranks: torch.Tensor | tuple[tuple[int, int, int], ...], quantizer: Quantizer,
    basis: torch.Tensor | None = None, counts: dict[int, int] | None = None, dtype: torch.dtype | None = None,
) -> dict[int, TensorMap]:
    """The residual entries of one block, by rank level: ``missing`` [B, H, n, D] (x minus its
    reconstruction), ``ranks`` [B, H, n], or fixed ranks known on the host, the same in every row and head: runs
    ``(start, stop, rank)`` of the block's tokens, ascending and apart, every other token at rank 0 (no host read).
    Token indices are relative to the block.

    Without ``basis``: the ``rho`` largest channels, with their indices. With ``basis`` [B, H, R, D]
    (a per-layer residual basis): the first ``rho`` coordinates on it, no indices needed. ``counts`` (rank -> entries,
    as the host knows them) spares the reads of the ranks present and of each level's entry count. ``dtype`` (default
    ``missing``'s): what values are quantized from (a float32 ``missing`` on a basis is projected with no 16-bit copy)."""
    batch, heads, tokens, dim = missing.shape
    if basis is not None:
        # rank-major [R, B x H x n]: entries selected along the long axis (not rows of R floats), copied side by side once
        by_rank = torch.einsum("bhnd,bhkd->kbhn", missing.float(), basis.float()).reshape(basis.shape[-2], -1)
    flat_missing = missing.reshape(-1, dim)
    fixed = not isinstance(ranks, torch.Tensor)
    if fixed and any(not 0 <= start < stop <= tokens for start, stop, _ in ranks):
        raise ValueError(f"encode_residuals: fixed runs {ranks} reach outside a block of {tokens} tokens")
    flat_ranks = None if fixed else ranks.reshape(-1)
    entries: dict[int, TensorMap] = {}
    if counts is not None:
        present = sorted(rank for rank, count in counts.items() if count)
    else:
        present = sorted({level for _, _, level in ranks}) if fixed else torch.unique(flat_ranks).tolist()
    for rank in present:
        if rank == 0:
            continue
        if fixed:
            chosen = _fixed_choice(ranks, rank, batch * heads, tokens, missing.device)
        elif counts is not None:
            chosen = torch.nonzero_static(flat_ranks == rank, size=counts[rank]).squeeze(1)
        else:
            chosen = (flat_ranks == rank).nonzero().squeeze(1)
        fields = {"row": (chosen // tokens).to(torch.int32), "token": (chosen % tokens).to(torch.int32)}
        if basis is None and rank >= dim:  # full rank: the whole vector, no channel indices
            values = flat_missing.index_select(0, chosen).to(dtype or missing.dtype)
        elif basis is None:
            picked = flat_missing.index_select(0, chosen)
            top = picked.abs().topk(rank, dim=-1).indices
            fields["index"] = top.to(torch.uint8)
            values = picked.gather(-1, top).to(dtype or missing.dtype)
        else:
            values = torch.empty(chosen.numel(), rank, dtype=dtype or missing.dtype, device=missing.device).copy_(by_rank[:rank].index_select(1, chosen).t())
        fields.update({f"q_{name}": t for name, t in quantizer.quantize(values).items()})
        entries[rank] = fields
    return entries


def add_residuals(
    vectors: torch.Tensor, lists: dict[int, TensorMap], quantizer: Quantizer, gates: torch.Tensor | None = None,
    basis: torch.Tensor | None = None, weight: float = 1.0, inplace: bool = False,
) -> torch.Tensor:
    """``vectors`` [B, H, T, D] plus ``weight`` times the residual entries ``lists`` (rank -> fields), each value
    scaled by its head's gate (``gates`` [H] in [0, 1], put on the device once; None = 1), on channels or on
    ``basis`` [B, H, R, D] as they were encoded. Returns a new tensor, or ``vectors`` added to ``inplace``."""
    batch, heads, tokens, dim = vectors.shape
    gates = on_device(gates, vectors.device)
    if basis is not None:
        return _add_on_basis(vectors, lists, quantizer, gates, basis, weight, inplace)
    out = vectors if inplace else vectors.clone()
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
        if "index" not in fields:  # a full-rank entry
            delta = values
        else:
            delta = torch.zeros(values.shape[0], dim, dtype=vectors.dtype, device=vectors.device)
            delta.scatter_(1, fields["index"].long(), values)
        flat.index_add_(0, rows * tokens + fields["token"].long(), delta)
    return out


def _add_on_basis(
    vectors: torch.Tensor, lists: dict[int, TensorMap], quantizer: Quantizer, gates: torch.Tensor | None,
    basis: torch.Tensor, weight: float, inplace: bool = False,
) -> torch.Tensor:
    """:func:`add_residuals` on a residual basis [B, H, R, D]: every entry's coordinates in a dense [B * H, T, R] table
    (zeros where a token has none; a token has one rank, so one entry at most), then one batched product with the basis
    (each entry's ``rank x D`` directions gathered would move R x D values an entry: hundreds of MB a prompt's block)."""
    batch, heads, tokens, dim = vectors.shape
    width = basis.shape[-2]
    table = torch.zeros(batch * heads * tokens, width, dtype=vectors.dtype, device=vectors.device)
    for rank, fields in lists.items():
        if not fields or fields["row"].numel() == 0:
            continue
        packed = {name[2:]: tensor for name, tensor in fields.items() if name.startswith("q_")}
        values = quantizer.dequantize(packed, vectors.dtype)
        table[fields["row"].long() * tokens + fields["token"].long(), :rank] = values
    if gates is not None:
        table = (table.view(batch, heads, tokens, width) * gates.to(vectors.dtype).view(1, heads, 1, 1)).view(-1, width)
    directions = basis.reshape(batch * heads, width, dim).to(vectors.dtype)
    # the product added as cuBLAS writes it (beta = 1): one pass over the vectors, not a product and then a sum
    out = vectors if inplace and vectors.is_contiguous() else vectors.clone(memory_format=torch.contiguous_format)
    out.view(batch * heads, tokens, dim).baddbmm_(table.view(batch * heads, tokens, width), directions, alpha=weight)
    return vectors.copy_(out) if inplace and out is not vectors else out


def entry_bytes(rank: int, quantizer: Quantizer, with_indices: bool = True) -> float:
    """Stored bytes of one residual entry at ``rank``: channel indices (uint8, unless on a residual basis or at full
    rank; pass ``with_indices=False`` then) and packed values. Where it is costs a bit of the list's bits, held for
    every token whether it has an entry or not (:func:`index_bytes`)."""
    return (rank if with_indices else 0) + quantizer.bytes_per_vector(rank, torch.float32)


def index_bytes(rows: int, first: int, tokens: int, tiles: bool) -> int:
    """The most a residual list's index grows by with a block of packed tokens ``first .. first + tokens`` of ``rows``
    rows: its bits' new words, the block's start, and with ``tiles`` the kernels' tile starts (:class:`ResidualList`).
    Bits cover the tokens up to a list's last block with entries (a kernel's tile index, every token it reads), so a
    block without entries at a level may add nothing there yet."""
    words = -(-(first + tokens) // TILE_TOKENS) - -(-first // TILE_TOKENS)
    return rows * words * 4 * (2 if tiles else 1) + 4


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
