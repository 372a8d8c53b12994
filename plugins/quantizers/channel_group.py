"""``channel-group``: 2/3/4-bit keys per channel over groups of tokens, with dense-and-sparse outliers.

Hooper, Kim, Mohammadzadeh, Mahoney, Shao, Keutzer, Gholami: "KVQuant: Towards 10 Million Context
Length LLM Inference with KV Cache Quantization" (NeurIPS 2024, arXiv:2401.18079): keys quantized per
channel (their outlier channels get their own range), before the rotary embedding (the pipeline's
``key_space = "pre-rope"``: RoPE mixes channel pairs differently at every position and blurs the
per-channel structure), with a few outliers per token kept exactly ("dense-and-sparse"); the grouping of
channel statistics over ``group`` consecutive tokens follows KIVI (Liu et al. 2024, arXiv:2402.02750),
so no offline calibration is needed.

Shapes: ``x`` [..., n, C] with the token axis at dim -2 and ``n`` a multiple of ``group``
(``tokens_per_group() = group``; the cache's ``block_tokens`` must be a multiple of it).

Outliers (``outliers = k`` per token): each element is scored by ``|x - m|``, its distance from the
median ``m`` of its channel over the token group, and the ``k`` elements of each token with the largest
score are stored exactly (float16) and left out of their channel's statistics, so a spike does not
stretch the range every other token of its channel is quantized in. The score is absolute, not divided
by the channel's spread, because the stored error is absolute (a wide channel's step costs more): on
SmolLM2-135M pre-RoPE keys (2 bits, group 32, k = 1) it gives a relative error of 0.147 against 0.154
for ``|x - m| / MAD``.

Levels (each (channel, token group) has two float16 statistics; an outlier's code is 0 and unused):

- ``levels = "uniform"``: ``zero`` the minimum (rounded down to float16) and ``scale = (max - zero) /
  (2**bits - 1)`` (rounded up) over the non-outlier elements; a code is ``round((x - zero) / scale)``,
  so every non-outlier element is within ``scale / 2`` of ``zero + code * scale``. The codes are computed
  with the stored scale, subnormal float16 ones included (a range below ``(2**bits - 1) * 2**-14``: the
  scale is rounded up to a multiple of ``2**-24``), so the bound holds for every range float16 holds.
- ``levels = "normal"``: ``mean`` and ``std`` of the non-outlier elements; the reconstruction is ``mean +
  std * z[code]`` with ``z`` the Lloyd-Max levels of N(0, 1) (2 bits: +-0.4528, +-1.5104), each element
  taking the nearest level (no half-step bound: the tails are clipped to the outer levels). It lowers the
  mean squared error at 2 bits only (SmolLM2-135M pre-RoPE keys, k = 1, group 32: 0.127 vs 0.147; at 3
  bits 0.070 vs 0.063), and even there it *raises* the attention-output error of keys (0.58 vs 0.27 with
  the model's own queries): attention lives on the large key entries the normal levels clip. It is
  kept for values and for 2-bit experiments; keys should use the default, uniform.

Defaults (``benchmarks/quantizer_error.py --model default``, attention-output error of keys alone over
the last 128 positions): 3 bits, group 32, one outlier, uniform: 0.116 at 4.38 bits per element, against
0.139 without the outlier, 0.097 with two, 0.128 post-RoPE, 0.27 at 2 bits and 0.20 for int4-group
(4.5 bits per element).

Range: every stored value is float16 (zero points, scales, means, deviations, the exact outliers), so the
input must lie within ``|x| <= 65504``; beyond it ``quantize`` raises a ``ValueError`` naming
``channel-group``, the largest magnitude and the limit (never an infinite field restoring NaN).

Stored fields (packed_format ``channel-group.v1``):

- ``codes`` uint8 [..., n, C * bits / 8]: each token's codes, bit-packed along the channels as a
  little-endian bit stream (code ``c`` at bits ``c * bits ..``; 3-bit codes 8 to 3 bytes; see ``_bitpack``);
  an outlier's code is 0 and unused;
- ``zero``, ``scale`` (uniform) or ``mean``, ``std`` (normal) float16 [..., n / group, C]: one row per
  group of tokens;
- when ``outliers > 0``: ``outlier_index`` uint8 [..., n, k] (channel, so C <= 256) and ``outlier_value``
  float16 [..., n, k], in descending score order.

Bytes per token and head: ``C * bits / 8 + 3 k + 4 C / group`` (C = 64, 3 bits, k = 1, group 32: 24 +
3 + 8 = 35 bytes, 3.7x below 16 bits; 2 bits: 27 bytes, 4.7x), whichever the levels.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import Quantizer
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer
from kvweave.kernels import pack as pack_kernels

from ._bitpack import affine_range, chunk_codes, level_table, nearest_level_codes, normal_levels, pack, safe_step, unpack  # noqa: F401 (normal_levels: read from here by the property tests)
from ._scales import FLOAT16_MAX, check_magnitude

#: channel indices of outliers are stored as uint8
MAX_OUTLIER_WIDTH = 256
#: the level placements: uniform steps over [min, max], or the Lloyd-Max levels of a fitted normal
LEVELS = ("uniform", "normal")


def _bits(_instance, attribute, value) -> None:
    if isinstance(value, bool) or value not in (2, 3, 4):
        raise ValueError(f"'{attribute.name}' must be 2, 3 or 4, got {value!r}")


def outlier_scores(grouped: torch.Tensor) -> torch.Tensor:
    """The outlier score ``|x - median|`` of every element of ``grouped`` [..., G, group, C] (float32), the
    median taken per channel over its group of tokens (dim -2)."""
    return (grouped - grouped.median(dim=-2, keepdim=True).values).abs()


def split_outliers(grouped: torch.Tensor, shape: torch.Size, count: int) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The mask of each token's ``count`` elements of largest outlier score in ``grouped`` [..., G, group, C]
    (None when ``count`` is 0) and their stored fields ``outlier_index``/``outlier_value`` (for an input
    shaped ``shape``)."""
    if not count:
        return None, {}
    index = outlier_scores(grouped).topk(count, dim=-1).indices  # [..., G, group, k]
    mask = torch.zeros_like(grouped, dtype=torch.bool).scatter_(-1, index, True)
    return mask, {
        "outlier_index": index.reshape(*shape[:-1], count).to(torch.uint8),
        "outlier_value": grouped.gather(-1, index).reshape(*shape[:-1], count).to(torch.float16),
    }


def channel_ranges(grouped: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (token group, channel) of ``grouped`` [..., G, group, C]: the minimum and maximum of the
    non-outlier elements (0, 0 where every element of the channel's group is an outlier)."""
    low_source = grouped if mask is None else grouped.masked_fill(mask, torch.inf)
    high_source = grouped if mask is None else grouped.masked_fill(mask, -torch.inf)
    low, high = low_source.amin(dim=-2), high_source.amax(dim=-2)
    empty = torch.isinf(low)
    return low.masked_fill(empty, 0.0), high.masked_fill(empty, 0.0)


@attrs.frozen
class ChannelGroupQuantizer(Quantizer):
    """``bits``-bit codes per channel over ``group`` tokens, ``outliers`` exact entries per token."""

    head_sharding: ClassVar[str] = "head-local"

    packed_format: ClassVar[str] = "channel-group.v1"

    bits: int = attrs.field(default=3, validator=_bits, metadata={"doc": "bits per code (2, 3 or 4)"})
    group: int = attrs.field(
        default=32, validator=integer(1, 1 << 16),
        metadata={"doc": "consecutive tokens sharing one scale and minimum per channel (divides block_tokens)"},
    )
    outliers: int = attrs.field(
        default=1, validator=integer(0, 64),
        metadata={"doc": "entries per token stored exactly (uint8 channel + float16 value), left out of the ranges"},
    )
    levels: str = attrs.field(
        default="uniform", validator=choice(LEVELS),
        metadata={"doc": "'uniform' (min + code * scale) or 'normal' (mean + std * Lloyd-Max level of N(0, 1))"},
    )

    def tokens_per_group(self) -> int:
        return self.group

    def check_width(self, width: int, where: str) -> None:
        codes = chunk_codes(self.bits)
        if width % codes:
            raise ModelError(
                f"{where}: channel-group packs {self.bits}-bit codes {codes} at a time; width {width} is not a "
                f"multiple of {codes} (accepted: widths divisible by {codes})"
            )
        if self.outliers and width > MAX_OUTLIER_WIDTH:
            raise ModelError(
                f"{where}: channel-group stores outlier channels as uint8, so width {width} > {MAX_OUTLIER_WIDTH} "
                "needs outliers = 0"
            )
        if self.outliers >= width:
            raise ModelError(f"{where}: channel-group outliers={self.outliers} must be below the width {width}")

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape[-2:]
        if tokens % self.group:
            raise ValueError(
                f"channel-group: {tokens} tokens (dim -2) are not a multiple of group={self.group}; the cache's "
                "block_tokens must be a multiple of the group"
            )
        return x.float().reshape(*x.shape[:-2], tokens // self.group, self.group, width)

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.check_width(x.shape[-1], "channel-group.quantize")
        grouped = self._grouped(x)  # [..., G, group, C]
        check_magnitude(
            "channel-group", torch.linalg.vector_norm(grouped, float("inf"), dim=-2), FLOAT16_MAX,  # abs().amax() in one pass
            "the largest float16: zero points, scales, means, deviations and the exact outliers are float16",
            source=x,
        )
        mask, fields = split_outliers(grouped, x.shape, self.outliers)
        if self.levels == "uniform" and self.group % pack_kernels.TOKEN_TILE == 0 and pack_kernels.fused(x):
            # codes and packing in one kernel: the torch path's passes over the block (and its int64 packing) left out
            zero, scale = affine_range(*channel_ranges(grouped, mask), self.bits)
            widths = torch.full(zero.shape, self.bits, dtype=torch.uint8, device=x.device)
            packed = pack_kernels.affine_varwidth(x, zero, scale, widths, x.shape[-1] * self.bits, fields.get("outlier_index"))
            return {"codes": packed, "zero": zero, "scale": scale, **fields}
        if self.levels == "uniform":
            codes, stats = self._uniform(grouped, mask)
        else:
            codes, stats = self._normal(grouped, mask)
        if mask is not None:
            codes = codes.masked_fill_(mask, 0)
        return {"codes": pack(codes.reshape(x.shape), self.bits), **stats, **fields}

    def _uniform(self, grouped: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        low, high = channel_ranges(grouped, mask)
        zero, scale = affine_range(low, high, self.bits)
        codes = torch.round((grouped - zero.float().unsqueeze(-2)) / safe_step(scale).unsqueeze(-2))
        return codes.clamp_(0, (1 << self.bits) - 1), {"zero": zero, "scale": scale}

    def _normal(self, grouped: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        weight = torch.ones_like(grouped) if mask is None else (~mask).float()
        count = weight.sum(dim=-2).clamp_min(1)
        mean = (grouped * weight).sum(dim=-2) / count
        std = ((grouped - mean.unsqueeze(-2)).square() * weight).sum(dim=-2).div(count).sqrt()
        mean, std = mean.to(torch.float16), std.to(torch.float16)
        codes = nearest_level_codes(grouped, mean.float().unsqueeze(-2), std.float().unsqueeze(-2), self.bits)
        return codes, {"mean": mean, "std": std}

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(packed["codes"], self.bits)
        if self.levels == "uniform":
            offset, step = packed["zero"].float(), packed["scale"].float()
            values = codes.float()
        else:
            offset, step = packed["mean"].float(), packed["std"].float()
            values = level_table(self.bits, str(codes.device))[codes]
        grouped = values.reshape(*offset.shape[:-2], offset.shape[-2], self.group, values.shape[-1])
        x = (grouped * step.unsqueeze(-2) + offset.unsqueeze(-2)).reshape(values.shape)
        if self.outliers:
            x = x.scatter_(-1, packed["outlier_index"].long(), packed["outlier_value"].float())
        return x.to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        return width * self.bits / 8 + 3 * self.outliers + 2 * 2 * width / self.group


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("channel-group", ChannelGroupQuantizer)
