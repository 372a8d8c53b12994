"""``channel-alloc``: keys per channel over groups of tokens, each group's bits spread over its channels.

``channel-group`` gives every channel the same number of bits. The channels of a key are far from alike:
before the rotary embedding a few carry most of the energy and many sit in a narrow range, and one bit more
halves a channel's step whatever its range. Giving the bits to the channels whose error is largest is the
classical bit allocation of transform coding (Huang and Schultheiss, "Block quantization of correlated
Gaussian random variables", IEEE Trans. Communication Systems 1963; Gersho and Gray, "Vector
Quantization and Signal Compression", 1992, ch. 8): for a channel of range ``r`` coded uniformly with ``b``
bits the squared error is proportional to ``r**2 * 4**-b``, so a bit given to a channel removes three
quarters of its error, and giving the bits one at a time to the largest remaining error is optimal.
The allocation is made per token group, batch row and head from the ranges the group itself has, so no
calibration is needed; the channel statistics, the outliers (KVQuant's dense-and-sparse, arXiv:2401.18079)
and the grouping over tokens (KIVI, arXiv:2402.02750) are ``channel-group``'s.

``pairs = true`` (the default) ties channel ``c`` to channel ``c + C/2``: the rotary embedding of Llama-style
models turns those two together, so keys stored before it (``key_space = "pre-rope"``) give both the same
width. Each token of a group then carries exactly ``mean_bits * C`` bits, so the codes stay a rectangular
tensor whatever the allocation.

Measured (``python benchmarks/quantizer_error.py --model default``, SmolLM2-135M pre-RoPE keys, group 64,
attention-output error of keys alone over the last 128 positions): without outliers ``mean_bits`` 3.0 gives
0.102, 3.25 0.084 and 3.5 0.070, against 0.132 and 0.060 for ``channel-group`` at 3 and 4 bits with one
outlier; 3.0 with one outlier 0.097 (more bytes than 3.25 without, for more error); 3.5 without tied pairs
0.083, and after RoPE (no pairs) 0.098.

``query_weight = w > 0`` (keys only) multiplies each channel's cost by the ``w``-th power of the mean energy
the layer's own queries have put on it (``quantize(x, channel_weights=...)``; the cache accumulates it,
engine/energy.py): a key channel's error reaches the logit multiplied by the query there. Measured the same
way: 3.0 bits 0.104 -> 0.094 with ``w = 0.5`` (0.101 with ``w = 1``), 3.5 bits 0.070 -> 0.062. ``layer_bits``
gives each layer of the model its own ``mean_bits`` (``for_layer``; plugins/quantizers/_layers.py).

Stored fields (packed_format ``channel-alloc.v1``), for ``x`` [..., n, C] with ``n`` a multiple of ``group``:

- ``codes`` uint8 [..., n, mean_bits * C / 8]: each token's codes as one little-endian bit stream, channel
  ``c`` taking ``bits[c]`` bits at offset ``sum(bits[:c])`` (a channel of 0 bits takes none);
- ``bits`` uint8 [..., n / group, C / 2 with pairs, else C]: the width of each (pair of) channel(s);
- ``zero``, ``scale`` float16 [..., n / group, C]: ``zero + code * scale`` per channel, every non-outlier
  element within ``scale / 2`` of it; a channel of 0 bits stores the midpoint of its range in ``zero``
  (its error is at most half its range, plus the float16 rounding of the midpoint);
- with ``outliers > 0``: ``outlier_index`` uint8 and ``outlier_value`` float16 [..., n, k], as
  ``channel-group``.

Bytes per token and head: ``mean_bits * C / 8 + 3 k + (4 C + C / 2) / group`` with pairs (C = 64, 3.5 bits,
k = 1, group 64: 28 + 3 + 4.5 = 35.5 bytes, against 39 for ``channel-group`` at 4 bits).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, Quantizer
from kvweave.core.lazy import torch
from kvweave.core.params import integer, number

from kvweave.kernels import pack as pack_kernels
from kvweave.kernels.formats import CHANNEL_ALLOC, MAX_CODE_BITS, unpack_varwidth, varwidth_offsets

from ._bitpack import affine_range, safe_step
from ._layers import check_table, each_entry, layer_table
from ._scales import FLOAT16_MAX, check_magnitude
from .channel_group import MAX_OUTLIER_WIDTH, channel_ranges, split_outliers

#: the widest code a channel may get
MAX_BITS = MAX_CODE_BITS


def _eighths(_instance, attribute, value) -> None:
    if value * 8 != int(value * 8):
        raise ValueError(f"'{attribute.name}' must be a multiple of 1/8 (whole bytes per 8 channels), got {value!r}")


_MEAN_BITS = number(1, MAX_BITS)


def _mean_bits(instance, attribute, value) -> None:
    _MEAN_BITS(instance, attribute, value)
    _eighths(instance, attribute, value)


def allocate(cost: torch.Tensor, total: int, max_bits: int) -> torch.Tensor:
    """Bits per entry of ``cost`` [..., P] (the squared error at 0 bits) summing to ``total`` over the last
    dim, each at most ``max_bits``: the ``total`` largest of the marginal gains ``cost * 4**-k`` (k = 0 ..
    max_bits - 1), which, decreasing in ``k`` for every entry, is what giving one bit at a time to the
    largest remaining error gives."""
    steps = torch.arange(max_bits, device=cost.device, dtype=torch.float32)
    gains = cost.float().unsqueeze(-1) * torch.pow(4.0, -steps)  # [..., P, max_bits]
    flat = gains.flatten(-2)
    chosen = torch.zeros_like(flat, dtype=torch.long).scatter_(-1, flat.topk(total, dim=-1).indices, 1)
    return chosen.reshape(gains.shape).sum(-1)


def pack_varwidth(codes: torch.Tensor, bits: torch.Tensor, total: int) -> torch.Tensor:
    """Codes [..., n, C] (code ``c`` below ``2**bits[c]``) with widths ``bits`` [..., G, C] (row ``g`` for the
    ``g``-th of ``G`` equal runs of tokens) summing to ``total`` (a multiple of 8) -> uint8 [..., n, total / 8]: one
    little-endian bit stream per token. A code of at most 8 bits shifted to its offset spans two bytes; codes share
    no bit, so adding them is or-ing."""
    *lead, tokens, channels = codes.shape
    widths, offsets = varwidth_offsets(bits, tokens)
    groups = widths.shape[-3]
    grouped = codes.reshape(*lead, groups, tokens // groups, channels).long()
    word = (grouped & ((1 << widths) - 1)) << (offsets % 8)
    stream = torch.zeros(*grouped.shape[:-1], total // 8 + 2, dtype=torch.long, device=codes.device)
    stream.scatter_add_(-1, (offsets // 8).expand(grouped.shape), word & 0xFF)
    stream.scatter_add_(-1, (offsets // 8 + 1).expand(grouped.shape), word >> 8)
    return stream[..., : total // 8].to(torch.uint8).reshape(*lead, tokens, total // 8)


@attrs.frozen
class ChannelAllocQuantizer(Quantizer):
    """Per-channel codes over ``group`` tokens, ``mean_bits`` per element spread over the channels by range."""

    head_sharding: ClassVar[str] = "head-local"

    packed_format: ClassVar[str] = CHANNEL_ALLOC

    mean_bits: float = attrs.field(
        default=3.5, validator=_mean_bits,
        metadata={"doc": "bits per element on average over a token's channels (a multiple of 1/8, 1 to 8)"},
    )
    group: int = attrs.field(
        default=64, validator=integer(1, 1 << 16),
        metadata={"doc": "consecutive tokens sharing one allocation, scale and minimum per channel (divides block_tokens)"},
    )
    outliers: int = attrs.field(
        default=1, validator=integer(0, 64),
        metadata={"doc": "entries per token stored exactly (uint8 channel + float16 value), left out of the ranges"},
    )
    max_bits: int = attrs.field(
        default=MAX_BITS, validator=integer(1, MAX_BITS), metadata={"doc": "the most bits one channel may get (1 to 8)"},
    )
    pairs: bool = attrs.field(
        default=True, validator=attrs.validators.instance_of(bool),
        metadata={"doc": "channel c and c + C/2 (turned together by Llama-style RoPE) share their width"},
    )
    query_weight: float = attrs.field(
        default=0.0, validator=number(0.0, 2.0),
        metadata={"doc": "0: a channel's cost is its range squared; w > 0: times the w-th power of the energy the layer's queries put on it (keys; 0.5 measured best)"},
    )
    layer_bits: tuple[float, ...] = attrs.field(
        default=(), converter=layer_table, validator=each_entry(_mean_bits, "mean_bits"),
        metadata={"doc": "mean_bits per layer, one entry per layer of the model (empty: 'mean_bits' for every layer)"},
    )

    @property
    def uses_query_energy(self) -> bool:
        """Whether the cache must hand :meth:`quantize` the queries' per-channel energy (engine/energy.py)."""
        return self.query_weight > 0

    def check_model(self, shape: ModelShape) -> None:
        check_table(self.layer_bits, shape.num_layers, "channel-alloc")

    def for_layer(self, layer: int) -> ChannelAllocQuantizer:
        return attrs.evolve(self, mean_bits=float(self.layer_bits[layer]), layer_bits=()) if self.layer_bits else self

    def tokens_per_group(self) -> int:
        return self.group

    def _units(self, width: int) -> tuple[int, int]:
        """(entries that get a width, bits to give them): pairs of channels take two bits a step."""
        entries = width // 2 if self.pairs else width
        return entries, round(self.mean_bits * entries)

    def check_width(self, width: int, where: str) -> None:
        entries = width // 2 if self.pairs else width
        if (self.pairs and width % 2) or self.mean_bits * entries != int(self.mean_bits * entries) or (self.mean_bits * width) % 8:
            raise ModelError(
                f"{where}: channel-alloc with mean_bits={self.mean_bits} gives a token of width {width} "
                f"{self.mean_bits * width:g} bits, which must be whole bytes"
                + (" over whole pairs of channels (an even width)" if self.pairs else "")
                + " (accepted: widths that are multiples of 16, with mean_bits a multiple of 1/8)"
            )
        entries, total = self._units(width)
        if total > entries * self.max_bits:
            raise ModelError(f"{where}: channel-alloc mean_bits={self.mean_bits} exceeds max_bits={self.max_bits}")
        if self.outliers and width > MAX_OUTLIER_WIDTH:
            raise ModelError(
                f"{where}: channel-alloc stores outlier channels as uint8, so width {width} > {MAX_OUTLIER_WIDTH} needs outliers = 0"
            )
        if self.outliers >= width:
            raise ModelError(f"{where}: channel-alloc outliers={self.outliers} must be below the width {width}")

    def quantize(self, x: torch.Tensor, channel_weights: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        """Pack ``x`` [..., n, C]; ``channel_weights`` [..., C] (the queries' mean energy per channel, with
        ``query_weight > 0``) scales each channel's cost by its ``query_weight``-th power."""
        tokens, width = x.shape[-2:]
        self.check_width(width, "channel-alloc.quantize")
        if tokens % self.group:
            raise ValueError(
                f"channel-alloc: {tokens} tokens (dim -2) are not a multiple of group={self.group}; the cache's "
                "block_tokens must be a multiple of the group"
            )
        grouped = x.float().reshape(*x.shape[:-2], tokens // self.group, self.group, width)
        check_magnitude(
            "channel-alloc", grouped.abs().amax(dim=-2), FLOAT16_MAX,
            "the largest float16: zero points, scales and the exact outliers are float16", source=x,
        )
        mask, fields = split_outliers(grouped, x.shape, self.outliers)
        low, high = channel_ranges(grouped, mask)  # [..., G, C]
        cost = (high - low).square()
        if self.query_weight > 0:
            if channel_weights is None or channel_weights.shape[-1] != width:
                raise ValueError(
                    f"channel-alloc with query_weight={self.query_weight} needs the queries' energy per channel "
                    f"([..., {width}]), got {None if channel_weights is None else tuple(channel_weights.shape)}"
                )
            energy = channel_weights.float().clamp_min(0)
            if self.pairs:  # a pair turns together under RoPE: its summed energy is what both channels see
                energy = energy[..., : width // 2] + energy[..., width // 2 :]
                energy = torch.cat((energy, energy), dim=-1)
            cost = cost * (energy / energy.mean(dim=-1, keepdim=True).clamp_min(1e-30)).pow(self.query_weight).unsqueeze(-2)
        if self.pairs:
            cost = cost[..., : width // 2] + cost[..., width // 2 :]
        entries, total = self._units(width)
        bits = allocate(cost, total, self.max_bits)
        per_channel = torch.cat((bits, bits), dim=-1) if self.pairs else bits
        zero, scale = affine_range(low, high, per_channel.clamp_min(1))
        middle = ((low + high) / 2).to(torch.float16)
        none = per_channel == 0
        zero = torch.where(none, middle, zero)
        scale = torch.where(none, torch.zeros_like(scale), scale)
        stream = total * (2 if self.pairs else 1)
        if self.group % pack_kernels.TOKEN_TILE == 0 and pack_kernels.fused(x):  # codes and packing in one kernel
            packed = pack_kernels.affine_varwidth(x, zero, scale, per_channel, stream, fields.get("outlier_index"))
            return {"codes": packed, "bits": bits.to(torch.uint8), "zero": zero, "scale": scale, **fields}
        codes = torch.round((grouped - zero.float().unsqueeze(-2)) / safe_step(scale).unsqueeze(-2))
        codes = torch.minimum(codes.clamp_(min=0), ((1 << per_channel) - 1).unsqueeze(-2).float())
        if mask is not None:
            codes = codes.masked_fill_(mask, 0)
        codes = codes.long().reshape(x.shape)
        packed = pack_varwidth(codes, per_channel, stream)
        return {"codes": packed, "bits": bits.to(torch.uint8), "zero": zero, "scale": scale, **fields}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        bits = packed["bits"].long()
        per_channel = torch.cat((bits, bits), dim=-1) if self.pairs else bits
        codes = unpack_varwidth(packed["codes"], per_channel)
        zero, scale = packed["zero"].float(), packed["scale"].float()
        groups, width = zero.shape[-2:]
        grouped = codes.float().reshape(*zero.shape[:-2], groups, self.group, width)
        x = (grouped * scale.unsqueeze(-2) + zero.unsqueeze(-2)).reshape(codes.shape)
        if self.outliers:
            x = x.scatter_(-1, packed["outlier_index"].long(), packed["outlier_value"].float())
        return x.to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        entries, total = self._units(width)
        stream = total * (2 if self.pairs else 1) / 8
        return stream + 3 * self.outliers + (2 * 2 * width + entries) / self.group


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("channel-alloc", ChannelAllocQuantizer)
