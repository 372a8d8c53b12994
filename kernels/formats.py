"""The packed formats the decode kernel reads in place, unpacked in torch (for the kernel's torch twin).

A quantizer declares the layout of its packed fields by name (``Quantizer.packed_format``); a kernel
declares the names it reads, so the kernels never import a quantizer. The layouts, as the ``int8-block``
and ``int4-group`` quantizers write them:

- ``int8-block.v1``: ``codes`` int8 [..., C] in [-127, 127] and ``scales`` [..., C / block] (one absmax
  scale per ``block`` consecutive channels; float16 unless the quantizer was told otherwise), value
  ``codes * scale``.
- ``int4-group.v1``: ``packed`` uint8 [..., C / 2] (channel ``2i`` in the low nibble, ``2i + 1`` in the high
  one, each stored as code + 8, codes in [-7, 7]) and ``scales`` [..., C / group] (one per ``group``
  consecutive channels), value ``(nibble - 8) * scale``.

In both, the channels per scale follow from the shapes (``C`` over the scales' width), so nothing but
the packed tensors is needed to unpack them.

The ``lowbit`` kernel reads two more (their scales and levels are documented with it,
:mod:`kvweave.kernels.lowbit_decode`): ``channel-group.v1`` keys and ``rotated-token.v1`` values, whose
``codes`` are uint8 [..., C * bits / 8], code ``c`` at bits ``c * bits ..`` of a little-endian stream
(:func:`unpack_codes` for 2, 4 and 8 bits). ``rotated-token-tiled.v1`` (and ``rotated-token-log8-tiled.v1``) values
hold 2- or 4-bit codes in tiles of :data:`VALUE_TILE` tokens, ``codes`` uint8 [..., n / 64, 8 bits C]: a tile is C
channels of four (2 bits) or eight (4 bits) little-endian 32-bit words. 2 bits: word ``q`` of channel ``c`` holds the
tile's 16 slots ``t`` with ``(t >> 1) & 3 == q``, slot ``t = 16 s + 8 h + 2 q + e`` at bits ``2 (8 h + 4 e + s)``;
4 bits: word ``4 w + q`` holds the 8 slots ``t = 32 w + 16 s + 8 h + 2 q + e`` at bits ``4 (4 e + 2 h + s)``
(:func:`tile_codes`, :func:`untile_codes`). That order is the ``dense`` kernel's: a thread of a Hopper warpgroup
product holds, of a [64 channels, 64 tokens] operand, two channels' slots ``2 q, 2 q + 1, 2 q + 8, 2 q + 9`` of each
16, that is one or two of these words a channel, so the operand is made from the words in registers
(kernels/lowbit_tile_triton.py).
"""

from __future__ import annotations

from kvweave.core.lazy import torch

INT8_BLOCK = "int8-block.v1"
INT4_GROUP = "int4-group.v1"
CHANNEL_GROUP = "channel-group.v1"
ROTATED_TOKEN = "rotated-token.v1"
#: ``rotated-token`` with one-byte scales: ``scale_log`` uint8 and a float16 ``scale_max`` per ``scale_tokens`` tokens
ROTATED_TOKEN_LOG8 = "rotated-token-log8.v1"
CHANNEL_ALLOC = "channel-alloc.v1"
#: ``rotated-token`` values with 2- or 4-bit codes in tiles of :data:`VALUE_TILE` tokens (layout above)
ROTATED_TOKEN_TILED = "rotated-token-tiled.v1"
ROTATED_TOKEN_LOG8_TILED = "rotated-token-log8-tiled.v1"
#: tokens of a tiled value layout's tile
VALUE_TILE = 64
#: the ``rotated-token`` layouts, those with one-byte scales, those in tiles
VALUE_FORMATS = (ROTATED_TOKEN, ROTATED_TOKEN_LOG8, ROTATED_TOKEN_TILED, ROTATED_TOKEN_LOG8_TILED)
LOG8_VALUE_FORMATS = (ROTATED_TOKEN_LOG8, ROTATED_TOKEN_LOG8_TILED)
TILED_VALUE_FORMATS = (ROTATED_TOKEN_TILED, ROTATED_TOKEN_LOG8_TILED)
#: the widest code of a variable-width stream (``channel-alloc.v1``)
MAX_CODE_BITS = 8


def int8_block_width(codes: torch.Tensor, scales: torch.Tensor) -> int:
    """Channels per scale of ``int8-block.v1`` fields: ``codes`` [..., C], ``scales`` [..., C / block]."""
    return codes.shape[-1] // scales.shape[-1]


def int4_group_width(packed: torch.Tensor, scales: torch.Tensor) -> int:
    """Channels per scale of ``int4-group.v1`` fields: ``packed`` [..., C / 2], ``scales`` [..., C / group]."""
    return 2 * packed.shape[-1] // scales.shape[-1]


def dequantize_int8_block(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``int8-block.v1`` -> values [..., C] in ``dtype`` (float32 when not given): ``codes`` int8 [..., C],
    ``scales`` [..., C / block]."""
    dtype = torch.float32 if dtype is None else dtype
    grouped = codes.reshape(*scales.shape, -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
    return grouped.reshape(codes.shape)


def dequantize_int4_group(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``int4-group.v1`` -> values [..., C] in ``dtype`` (float32 when not given): ``packed`` uint8 [..., C / 2],
    ``scales`` [..., C / group]."""
    dtype = torch.float32 if dtype is None else dtype
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    codes = torch.stack((low, high), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
    grouped = codes.reshape(*scales.shape, -1).to(dtype) * scales.to(dtype).unsqueeze(-1)
    return grouped.reshape(codes.shape)


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., C * bits / 8], one little-endian bit stream of codes (code ``c`` at bits ``c * bits ..``;
    1 to 8 bits a code) -> int64 [..., C]."""
    if 8 % bits == 0:  # whole codes in each byte
        shifts = torch.arange(8 // bits, device=packed.device) * bits
        return ((packed.long().unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)
    width = packed.shape[-1] * 8 // bits
    widths = torch.full((1, width), bits, dtype=torch.long, device=packed.device)
    flat = packed.reshape(-1, packed.shape[-1])  # every channel as wide: the variable-width stream's reader
    return unpack_varwidth(flat, widths).reshape(*packed.shape[:-1], width)


def varwidth_offsets(bits: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Widths [..., G, C] of ``tokens`` tokens' bit streams, row ``g`` for the ``g``-th run of ``tokens / G``
    consecutive tokens -> (widths, each channel's bit offset in its stream), int64 [..., G, 1, C]: broadcast over
    the tokens grouped as [..., G, tokens / G, C]. Offsets are summed per row, not per token."""
    groups = bits.shape[-2]
    if tokens % groups:
        raise ValueError(f"variable-width codes: {groups} rows of widths do not divide {tokens} tokens into equal runs")
    bits = bits.long()
    return bits.unsqueeze(-2), (bits.cumsum(-1) - bits).unsqueeze(-2)


def unpack_varwidth(packed: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n, total / 8], one little-endian bit stream per token whose channel ``c`` takes ``bits[c]``
    bits at offset ``sum(bits[:c])`` (``channel-alloc.v1``), with widths ``bits`` [..., G, C] (row ``g`` for the
    ``g``-th of ``G`` equal runs of tokens; 1 for all) -> int64 codes [..., n, C] (a channel of 0 bits reads 0). A
    code of at most 8 bits lies within two bytes: each channel reads the byte its offset falls in and the next one
    (the last byte stands in for the next where the stream ends, which no code reaches into)."""
    *lead, tokens, size = packed.shape
    widths, offsets = varwidth_offsets(bits, tokens)
    groups, channels = widths.shape[-3], widths.shape[-1]
    shape = (*lead, groups, tokens // groups, channels)
    stream = packed.reshape(*lead, groups, tokens // groups, size).long()
    index = (offsets // 8).clamp_max(size - 1)  # a 0-bit channel at the stream's end points past it, and reads 0
    word = stream.gather(-1, index.expand(shape)) | (stream.gather(-1, (index + 1).clamp_max(size - 1).expand(shape)) << 8)
    return ((word >> (offsets % 8)) & ((1 << widths) - 1)).reshape(*lead, tokens, channels)


def tile_codes(codes: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """Integer ``bits``-bit codes (2 or 4) [..., n, C] (``n`` a multiple of :data:`VALUE_TILE`) -> the same codes
    [..., n / 64, 64 C] in the tiled order; packed ``bits`` a code, little-endian, they are the tiled layout's bytes.
    2 bits: channel, word ``q``, then place ``8 h + 4 e + s`` for slot ``16 s + 8 h + 2 q + e``. 4 bits: channel, word
    ``4 w + q``, then place ``4 e + 2 h + s`` for slot ``32 w + 16 s + 8 h + 2 q + e``."""
    *lead, tokens, channels = codes.shape
    if tokens % VALUE_TILE:
        raise ValueError(f"tiled values take whole tiles of {VALUE_TILE} tokens, got {tokens} tokens")
    n, tiles = len(lead), tokens // VALUE_TILE
    if bits == 2:
        split = codes.reshape(*lead, tiles, 4, 2, 4, 2, channels)  # tile, s, h, q, e, channel
        order = (n, n + 5, n + 3, n + 2, n + 4, n + 1)  # tile, channel, q, h, e, s
    elif bits == 4:
        split = codes.reshape(*lead, tiles, 2, 2, 2, 4, 2, channels)  # tile, w, s, h, q, e, channel
        order = (n, n + 6, n + 1, n + 4, n + 5, n + 3, n + 2)  # tile, channel, w, q, e, h, s
    else:
        raise ValueError(f"tiled values hold 2- or 4-bit codes, got {bits}")
    return split.permute((*range(n), *order)).reshape(*lead, tiles, channels * VALUE_TILE)


def untile_codes(tiled: torch.Tensor, bits: int = 2) -> torch.Tensor:
    """The inverse of :func:`tile_codes`: codes [..., m, 64 C] in the tiled order -> [..., 64 m, C] token by token."""
    *lead, tiles, width = tiled.shape
    channels, n = width // VALUE_TILE, len(lead)
    if bits == 2:
        split = tiled.reshape(*lead, tiles, channels, 4, 2, 2, 4)  # tile, channel, q, h, e, s
        order = (n, n + 5, n + 3, n + 2, n + 4, n + 1)  # tile, s, h, q, e, channel
    elif bits == 4:
        split = tiled.reshape(*lead, tiles, channels, 2, 4, 2, 2, 2)  # tile, channel, w, q, e, h, s
        order = (n, n + 2, n + 6, n + 5, n + 3, n + 4, n + 1)  # tile, w, s, h, q, e, channel
    else:
        raise ValueError(f"tiled values hold 2- or 4-bit codes, got {bits}")
    return split.permute((*range(n), *order)).reshape(*lead, tiles * VALUE_TILE, channels)
