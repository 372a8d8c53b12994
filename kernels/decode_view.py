"""What the decode kernel reads of one layer (:class:`DecodeView`), and how its packed tokens are cut
into the segments of one program each.

The view holds the stored tensors themselves (no copies), as the kernel indexes them: int8 coefficients
and their scales (``int8-block.v1``), the basis of every version, the residual entries of each rank
level with their tile index (``int4-group.v1``), the residual bases and gates, and the exact window.
``kvweave.plugins.kernels.fused`` builds it from a :class:`kvweave.core.view.LayerView`.

Shapes: ``B`` batch, ``H`` KV heads, ``T`` packed tokens, ``r`` coefficient rank, ``V`` basis versions,
``D`` head dim, ``N`` residual entries of a level, ``R`` residual basis rank, ``W`` exact tokens.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from kvweave.core.lazy import torch

TILE = 32  # tokens per kernel tile = per residual tile-index entry
MAX_LEVELS = 3  # residual rank levels (> 0) the kernel takes


@attrs.frozen
class ResidualLevel:
    """One rank level's residual entries of one layer and kind (see :mod:`kvweave.engine.residuals`). The kernels
    find an entry through the tile index; the torch twin reads each entry's ``token`` and ``row``, which
    ``locate`` derives from the level's bits (the entries store neither)."""

    rank: int
    group: int  # int4 channels per scale at this rank
    entries: int  # N
    packed: torch.Tensor  # uint8 [N, rank / 2]
    scales: torch.Tensor  # float16 [N, rank / group]
    tile_start: torch.Tensor  # int32 [B * H, tiles]: first entry of each (row, 32-token tile)
    tile_mask: torch.Tensor  # int32 [B * H, tiles]: bit i set when token 32 * tile + i has an entry
    locate: Any = attrs.field(default=None, eq=False, repr=False)  # () -> (row, token) int32 [N] each

    def located(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's row ``b * H + h`` and packed-token index (int32 [N] each)."""
        if not self.entries:
            empty = self.tile_start.new_zeros(0)
            return empty, empty
        if self.locate is None:
            raise ValueError(f"residual level {self.rank} holds {self.entries} entries but no way to locate them")
        return self.locate()


@attrs.frozen
class DecodeView:
    """Everything one layer's decode attention reads, as views of the stored tensors (no copies)."""

    packed_tokens: int
    k_codes: torch.Tensor  # int8 [B, H, T, r]
    k_scales: torch.Tensor  # float16 [B, H, T, r / block]
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    k_bases: torch.Tensor  # float16 [B, H, V, r, D] (a column view of the window's bases)
    v_bases: torch.Tensor
    segments: torch.Tensor  # int32 [S, 3] on the device: start, end, version
    k_levels: tuple[ResidualLevel, ...]
    v_levels: tuple[ResidualLevel, ...]
    k_residual_basis: torch.Tensor | None  # float16 [B, H, R, D]
    v_residual_basis: torch.Tensor | None
    k_gates: torch.Tensor | None  # float32 [H]
    v_gates: torch.Tensor | None
    exact_k: torch.Tensor  # [B, H, W, D] model dtype
    exact_v: torch.Tensor
    #: a window kept for a CUDA graph (:mod:`kvweave.engine.graphs`): int32 [1] on the device, the tokens it held before
    #: this step's; ``exact_k`` / ``exact_v`` are then buffers of a capacity whose first ``fill + 1`` rows are the
    #: window. None: every row of ``exact_k`` is the window's
    exact_fill: torch.Tensor | None = None

    @property
    def block(self) -> int:
        """Coefficient channels per int8 scale."""
        return self.k_codes.shape[-1] // self.k_scales.shape[-1]


def version_segments(version_tokens: list[int], split: int, device: torch.device) -> torch.Tensor:
    """Cut tokens ``0 .. sum(version_tokens)`` into segments of at most ``split`` tokens that never cross a
    version boundary: int32 [S, 3] (start, end, version) on ``device``. ``split`` and every version's
    token count must be multiples of :data:`TILE`."""
    rows, start = [], 0
    for version, count in enumerate(version_tokens):
        end = start + count
        for lo in range(start, end, split):
            rows.append((lo, min(lo + split, end), version))
        start = end
    if not rows:
        return torch.zeros(0, 3, dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)


#: from this many rows (batch x KV heads; B = 8 at 8 KV heads) to :data:`WAVE_MAX_ROWS` (B = 32, the most timed) the
#: tiles pass's programs are one wave of about
#: :data:`WAVE_PROGRAMS` (12 one-warp programs an SM of an H100/H200: a build in at most 168 registers; Triton 3.9's is
#: capped at 160 for it, kvweave.kernels.depthweave_decode.tiles_register_cap), segments of at most :data:`WAVE_MAX_SPLIT` tokens.
#: H100, 2026-12-07 (docs/kernels.md "depthweave-kv's splits timed"): B = 8 3.05x -> 3.79x SDPA at 32K (1,536 programs
#: of 1,376 tokens instead of 1,088 of 1,952), 3.79x -> 4.21x at 64K, 4.47x -> 4.50x at 128K; B = 32 4.38x -> 4.42x,
#: 4.53x -> 4.59x, 4.72x both; at one row 1,024 programs (the rule below) were the fastest of those timed
WAVE_ROWS, WAVE_MAX_ROWS = 64, 256
WAVE_PROGRAMS = 1584
WAVE_MAX_SPLIT = 5472


def choose_split(tokens: int, programs_per_token_split: int, target_programs: int = 1056, max_split: int = 2048) -> int:
    """Tokens per segment, a multiple of :data:`TILE`, at least 256. From :data:`WAVE_ROWS` to :data:`WAVE_MAX_ROWS`
    rows (``programs_per_token_split``): ``WAVE_PROGRAMS // rows`` segments a row, one wave, at most
    :data:`WAVE_MAX_SPLIT` tokens each. Other rows: enough programs to fill the GPU (about ``target_programs`` for all rows and heads), at
    most ``max_split`` tokens each."""
    if tokens <= 0:
        return 256
    rows = max(1, programs_per_token_split)
    if WAVE_ROWS <= rows <= WAVE_MAX_ROWS:
        split = min(max(256, math.ceil(tokens / max(1, WAVE_PROGRAMS // rows))), WAVE_MAX_SPLIT)
        return math.ceil(split / TILE) * TILE
    splits = max(1, math.ceil(target_programs / rows))
    split = min(max(256, math.ceil(tokens / splits)), max_split)
    return math.ceil(split / TILE) * TILE


def version_counts(segments: torch.Tensor) -> list[int]:
    """The tokens of each basis version that ``segments`` [S, 3] (start, end, version) hold."""
    counts = [0] * (int(segments[:, 2].max()) + 1)
    for lo, hi, version in segments.tolist():
        counts[version] += hi - lo
    return counts


def resplit(segments: torch.Tensor, split: int) -> torch.Tensor:
    """The tokens of ``segments`` [S, 3] cut again, per version, into segments of at most ``split`` tokens
    (tests and benchmarks; a view's own segments are cut when the cache is read)."""
    return version_segments(version_counts(segments), split, segments.device)


_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A one-element tensor of ``dtype`` (int32 when not given) on ``device``, made once: what a kernel
    argument points to when its input is absent (a missing residual level, no gates), so decode steps launch
    no kernel to make one."""
    dtype = torch.int32 if dtype is None else dtype
    key = (torch.device(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def check_view(view: DecodeView, query: torch.Tensor) -> None:
    """Raise ValueError naming the first input the kernel cannot take (``query`` [B, Hq, D])."""
    if query.dim() != 3:
        raise ValueError(f"query must be [B, Hq, D], got {tuple(query.shape)}")
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    if q_heads % heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {heads} KV heads")
    if dim & (dim - 1) or dim < 32:
        raise ValueError(f"head_dim {dim} must be a power of two of at least 32 (64, 128 and 256 are tested)")
    if view.exact_k.shape[0] != batch or view.exact_k.shape[-1] != dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the exact window {tuple(view.exact_k.shape)}")
    if view.packed_tokens:
        rank = view.k_codes.shape[-1]
        if rank > 64:
            raise ValueError(f"coefficient rank {rank} is above the kernel's 64")
        if view.k_codes.stride() != view.v_codes.stride() or view.k_scales.stride() != view.v_scales.stride():
            raise ValueError("key and value coefficients must share one layout")
        if view.k_codes.stride(-1) != 1 or view.k_scales.stride(-1) != 1 or view.k_bases.stride(-1) != 1:
            raise ValueError("coefficients, scales and bases must be contiguous along their last dimension")
        if view.k_bases.stride() != view.v_bases.stride():
            raise ValueError("key and value bases must share one layout")
        if len(view.k_levels) > MAX_LEVELS or len(view.k_levels) != len(view.v_levels):
            raise ValueError(f"the kernel takes at most {MAX_LEVELS} residual levels, the same for keys and values")
        if view.packed_tokens % TILE:
            raise ValueError(f"packed tokens ({view.packed_tokens}) must be a multiple of {TILE}")
