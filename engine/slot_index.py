"""Which cache index each stored slot of an evicting layer holds, in the fewer bytes of two forms.

An evicting flush stores, per batch row and KV head, the kept tokens of the ``count`` tokens leaving the exact
window in order (ascending cache index), then filler slots (-1) up to the largest kept count of any row
(:meth:`kvweave.engine.eviction.Eviction._kept_index`). Two forms hold that exactly:

- ``listed``: the cache index of every slot, int16 (int32 past 32,767 tokens): 2 bytes a slot;
- ``bits``: one bit per token that passed through the flushes (kept or not), packed eight to a byte, plus each
  flush's token and slot count (two int32 a flush, counted); a slot's index is its bit's place, its order the
  bit's rank within its flush, fillers what a flush's slots leave over. 1/8 byte a passed token.

A layer that keeps more than one token in sixteen is smaller as bits (KVzip, SnapKV at their usual shares), one
that keeps a few (StreamingLLM's sinks) as a list; :class:`SlotIndex` stores whichever is smaller after every
write, the same positions either way (a write the bits cannot hold, e.g. indices out of order, stays listed).
Readers get the positions decoded (:attr:`SlotIndex.positions`, made for the call and not kept: a few
``cumsum``/``scatter`` over the passed tokens, no host sync). A kernel that reads the packed storage in place
(``lowbit``, ``fused``) takes the list every decode step, so the engine keeps the list for it (``bits=False``).
"""

from __future__ import annotations

import torch

#: bytes each flush's record (tokens and slots, two int32) adds to the bits form
FLUSH_RECORD_BYTES = 8


def position_dtype(tokens: int) -> torch.dtype:
    """The integer type stored slots' cache indices take (-1 for a filler): int16 while every index of a
    ``tokens``-token cache fits, else int32 (stored indices are widened when a cache grows past it)."""
    return torch.int16 if tokens <= 32767 else torch.int32


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [..., n] -> uint8 [..., ceil(n / 8)], bit j of byte i holding ``mask[..., 8 i + j]``."""
    n = mask.shape[-1]
    padded = torch.nn.functional.pad(mask.to(torch.uint8), (0, (-n) % 8)).reshape(*mask.shape[:-1], -1, 8)
    weights = (1 << torch.arange(8, device=mask.device, dtype=torch.uint8))
    return (padded * weights).sum(-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of :func:`pack_bits`: uint8 [..., m] -> bool [..., n]."""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(*packed.shape[:-1], -1)[..., :n]


class SlotIndex:
    """The cache index of each stored slot of one layer, [B, H, slots] when decoded, -1 for a filler."""

    def __init__(self, bits: bool = True) -> None:
        self.allow_bits = bits  # False: always listed (for a reader that takes the list every step)
        self.listed: torch.Tensor | None = None  # int16/int32 [B, H, slots]
        self.bits: torch.Tensor | None = None  # uint8 [B, H, ceil(tokens / 8)] over cache indices origin ..
        self.origin = 0  # the cache index of the first token the flushes covered
        self.flush_tokens: list[int] = []  # tokens each flush covered (in order, contiguous from origin)
        self.flush_slots: list[int] = []  # slots each flush stored

    @property
    def slots(self) -> int:
        return sum(self.flush_slots)

    @property
    def tokens(self) -> int:
        return sum(self.flush_tokens)

    def empty(self) -> bool:
        return self.listed is None and self.bits is None

    @property
    def positions(self) -> torch.Tensor | None:
        """The cache index of each slot, [B, H, slots] in :func:`position_dtype`, or None before any flush."""
        if self.listed is not None:
            return self.listed
        if self.bits is None:
            return None
        return self._decode()

    def append(self, new: torch.Tensor, start: int, count: int) -> None:
        """Add a flush that covered cache indices ``start .. start + count`` and stored ``new`` [B, H, s] (kept
        indices in order, then -1)."""
        if self.empty():
            self.origin, self.flush_tokens, self.flush_slots = start, [], []
        elif start != self.origin + self.tokens:
            raise ValueError(f"a flush from cache index {start} does not follow the {self.tokens} tokens flushed from {self.origin}")
        old = self.positions
        dtype = position_dtype(start + count)
        joined = new.to(dtype) if old is None else torch.cat((old.to(dtype), new.to(dtype)), dim=-1)
        self.flush_tokens.append(count)
        self.flush_slots.append(new.shape[-1])
        self._store(joined)

    def replace(self, positions: torch.Tensor, count: int) -> None:
        """Every slot anew: ``positions`` [B, H, s] chosen among cache indices 0 .. count (a re-selecting flush)."""
        self.origin, self.flush_tokens, self.flush_slots = 0, [count], [positions.shape[-1]]
        self._store(positions.to(position_dtype(count)))

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep batch rows ``index`` (reordering and repeats allowed)."""
        if self.listed is not None:
            self.listed = self.listed.index_select(0, index.to(self.listed.device))
        if self.bits is not None:
            self.bits = self.bits.index_select(0, index.to(self.bits.device))

    def stored(self) -> list[torch.Tensor]:
        """The tensors held (what the cache's byte count adds)."""
        return [t for t in (self.listed, self.bits) if t is not None]

    def record_bytes(self) -> int:
        """The flush records the bits form needs (zero while listed)."""
        return FLUSH_RECORD_BYTES * len(self.flush_tokens) if self.bits is not None else 0

    # ---------------------------------------------------------------------------------------------- forms
    def _store(self, positions: torch.Tensor) -> None:
        batch, heads, slots = positions.shape
        listed_bytes = positions.numel() * positions.element_size()
        bits_bytes = batch * heads * (-(-self.tokens // 8)) + FLUSH_RECORD_BYTES * len(self.flush_tokens)
        self.listed, self.bits = positions, None
        if not self.allow_bits or bits_bytes >= listed_bytes or slots == 0:
            return
        real = positions >= 0
        offset = (positions.long() - self.origin).clamp(0, max(self.tokens - 1, 0))
        mask = torch.zeros(batch, heads, self.tokens, dtype=torch.uint8, device=positions.device)
        mask.scatter_reduce_(-1, offset, real.to(torch.uint8), reduce="amax")  # a filler adds nothing
        self.bits = pack_bits(mask.bool())
        if torch.equal(self._decode(), positions):
            self.listed = None
        else:  # not the shape flushes leave (out of order, repeated, or out of range): kept as listed
            self.bits = None

    def _decode(self) -> torch.Tensor:
        """Positions from the bits: a set bit's slot is its flush's first slot plus its rank within the flush."""
        assert self.bits is not None
        tokens, slots = self.tokens, self.slots
        device = self.bits.device
        mask = unpack_bits(self.bits, tokens)
        batch, heads = mask.shape[:2]
        counts = torch.tensor(self.flush_tokens, device=device)
        flush = torch.repeat_interleave(torch.arange(len(self.flush_tokens), device=device), counts)  # [tokens]
        token_start = (torch.cumsum(counts, 0) - counts)[flush]
        slot_counts = torch.tensor(self.flush_slots, device=device)
        slot_start = (torch.cumsum(slot_counts, 0) - slot_counts)[flush]
        before = torch.cumsum(mask, -1, dtype=torch.int64) - mask.long()  # set bits before each token
        rank = before - before.gather(-1, token_start.expand(batch, heads, tokens))
        slot = torch.where(mask, slot_start + rank, slots)  # a clear bit goes to a spare column
        out = torch.full((batch, heads, slots + 1), -1, dtype=torch.int64, device=device)
        index = torch.arange(tokens, device=device).expand(batch, heads, tokens) + self.origin
        out.scatter_(-1, slot, torch.where(mask, index, -1))
        return out[..., :slots].to(position_dtype(self.origin + tokens))
