"""``rotated-token``: 2/3/4-bit values per token after a fixed orthogonal rotation of the channels.

Ashkboos, Mohtashami, Croci, Li, Cameron, Jaggi, Alistarh, Hoefler, Hensman: "QuaRot: Outlier-Free 4-Bit
Inference in Rotated LLMs" (NeurIPS 2024, arXiv:2404.00456): multiplying a vector by a random orthogonal
(Hadamard) matrix spreads a few large channels over all of them, so one scale per group of channels no
longer has to cover an outlier; QuaRot applies this to the KV cache by rotating each head's keys and
values before quantizing them per token. Here the rotation is internal to the quantizer: it is undone
at dequantization, so the cache and the attention see ordinary vectors.

Shapes: ``x`` [..., C] (any leading dims; one vector per token and head). ``y = x Q^T`` with ``Q`` [C, C]:

- ``rotation = "hadamard"``: ``Q = H_C D / sqrt(C)``, ``H_C`` the Sylvester Hadamard matrix (C a power of
  two) and ``D`` a diagonal of +-1 drawn from ``seed`` (so a structured input, e.g. a one-hot channel, is
  not mapped to a flat +-1 pattern that every seed would share);
- ``rotation = "random"``: the Q factor of the QR decomposition of a ``seed``-ed Gaussian C x C matrix
  (signs fixed so that R has a positive diagonal): Haar-distributed, any C;
- ``rotation = "none"``: ``Q = I``, plain per-token groups (the ablation the rotation is measured against).

``Q`` is regenerated from (rotation, seed, C) on every call (cached per device), never stored: it costs no
bytes, and every head of every layer uses the same one. ``y`` is quantized per token in groups of ``group``
channels (``min(group, C)``), each group reconstructed as ``zero + level(code) * scale`` (``zero = 0`` when
symmetric), all scalars float16:

- ``levels = "normal"`` (default): a rotated vector's coordinates are close to Gaussian (that is what the
  rotation does), so ``level`` is the Lloyd-Max level of N(0, 1) (2 bits: +-0.4528, +-1.5104), ``scale``
  the group's RMS (symmetric) or standard deviation around ``zero`` = its mean, and each element takes
  the nearest level. No half-step bound: an element beyond the outer level is clipped to it.
- ``levels = "uniform"``, symmetric: mid-rise levels ``code - (2**bits - 1) / 2`` (2 bits: -1.5, -0.5,
  0.5, 1.5; all ``2**bits`` levels used), ``scale`` rounded up so the outer level covers the group's
  absmax; asymmetric: ``level = code``, ``zero`` the group's minimum rounded down and ``scale`` rounded
  up (to a multiple of ``2**-24`` in float16's subnormal range, below ``2**-14``). The codes are computed
  with the stored scale, subnormal ones included, so every rotated element is within ``scale / 2`` of its
  level; rotating back by the orthogonal ``Q^T`` keeps the error's norm, so ``||x - x_hat|| <= ||scale /
  2||`` over the vector's groups.

Range: the scales and zero points are float16, so the rotated elements must lie within ``|y| <= 65504``
(always so when a vector's norm is at most 65504; the rotation can gather a vector's norm into one
element); beyond it ``quantize`` raises a ``ValueError`` naming ``rotated-token``, the largest rotated
magnitude and the limit (never an infinite scale restoring NaN).

Defaults, measured on SmolLM2-135M values (``benchmarks/quantizer_error.py --model default``, C = 64):
2 bits, group 64, symmetric, normal levels. The relative error at 2 / 3 / 4 bits is 0.34 / 0.18 / 0.095
with normal levels against 0.50 / 0.21 / 0.100 uniform; the attention-output error of values alone at 2
bits is 0.24 (normal) against 0.33 (uniform), 0.29 (uniform asymmetric, 2 more bytes), 0.24 (normal,
group 32 or asymmetric: 2 more bytes for nothing), 0.32 without the rotation and 0.29 for KIVI's 2-bit
values (3 bits per element). 2 bits keep the metadata at 0.25 bit per element and, with 3-bit
``channel-group`` keys, a cache 4.8x below 16 bits.

``layer_bits`` gives each layer of the model its own ``bits`` and ``layer_levels`` its own ``levels`` (``for_layer``;
plugins/quantizers/_layers.py; with ``token_tiles`` the widths may mix 2 and 4):
``benchmarks/layer_sensitivity.py`` measures which layers lose most at 2 bits and prints a table for an
average (SmolLM2-135M, 2.5 bits on average: KL 0.045 against 0.059 for as many 3-bit layers evenly spaced).

Stored fields (packed_format ``rotated-token.v1``): ``codes`` uint8 [..., C * bits / 8] (the rotated
channels' codes as a little-endian bit stream, code ``c`` at bits ``c * bits ..``, see ``_bitpack``),
``scale`` float16 [..., C / group] and, when not symmetric, ``zero`` float16 [..., C / group]. Bytes per
vector: ``C * bits / 8 + 2 * C / group`` (+ as much again for ``zero``): C = 64, 2 bits, group 64,
symmetric: 16 + 2 = 18 bytes (0.25 bit per element of metadata; 7.1x below 16 bits).

``scale_format = "log8"`` (packed_format ``rotated-token-log8.v1``) stores each scale in one byte instead:
``scale_log`` uint8 [..., n, C / group], ``k`` for ``scale_max * 2**(-k / 16)`` (16 steps an octave, 4.4 %
apart, 16 octaves deep), and ``scale_max`` float16 [..., n / scale_tokens, C / group], the largest scale of
each ``scale_tokens`` (64) tokens, rounded up. Normal levels take the nearest step (the RMS need not
be exact: relative error 0.3372 against 0.3371 at 2 bits on SmolLM2's values, ``benchmarks/quantizer_error.py``); uniform levels take the
step at or above the wanted scale, so the range stays covered. C = 64, 2 bits: 16 + 1 bytes a vector and 2
bytes per 64 tokens (0.129 bit per element of metadata).

``token_tiles = 64`` (2- or 4-bit codes; packed_format ``rotated-token-tiled.v1`` / ``rotated-token-log8-tiled.v1``)
stores the same codes in another order: ``codes`` uint8 [..., n / 64, 8 bits C], each tile of 64 tokens channel by
channel in four or eight 32-bit words (:func:`kvweave.kernels.formats.tile_codes` gives the order), the order in which the
``lowbit`` kernel's ``dense`` variant makes its value operands in registers (docs/kernels.md, "Values stored in
tiles"). The same bytes; a block holds whole tiles (``tokens_per_group``).
"""

from __future__ import annotations

import functools
import math
from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, Quantizer
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer

from kvweave.kernels import pack as pack_kernels
from kvweave.kernels.formats import VALUE_TILE, tile_codes, untile_codes

from ._bitpack import (
    affine_range, chunk_codes, level_table, midrise_scale, nearest_level_codes, normal_edges, normal_levels, pack, safe_step, unpack,
)
from ._layers import check_table, each_entry, layer_table, name_table
from ._scales import FLOAT16_MAX, check_magnitude

ROTATIONS = ("hadamard", "random", "none")
LEVELS = ("normal", "uniform")
SCALE_FORMATS = ("float16", "log8")
TOKEN_TILES = (0, VALUE_TILE)
LOG8_STEPS = 16  # log8 scales: 16 steps per octave (4.4 % apart), 256 codes span 16 octaves below the maximum


def _bits(_instance, attribute, value) -> None:
    if isinstance(value, bool) or value not in (2, 3, 4):
        raise ValueError(f"'{attribute.name}' must be 2, 3 or 4, got {value!r}")


def _flag(_instance, attribute, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"'{attribute.name}' must be true or false, got {value!r}")


def hadamard(width: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``width`` (a power of two), float64 entries +-1."""
    if width < 1 or width & (width - 1):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two order, got {width}")
    matrix = torch.ones(1, 1, dtype=torch.float64)
    while matrix.shape[0] < width:
        matrix = torch.cat((torch.cat((matrix, matrix), 1), torch.cat((matrix, -matrix), 1)), 0)
    return matrix


@functools.lru_cache(maxsize=64)
def rotation_matrix(rotation: str, seed: int, width: int, device: str = "cpu") -> torch.Tensor:
    """``Q`` [C, C] float32 on ``device`` (orthogonal; deterministic in ``rotation``, ``seed``, ``width``).
    Built in float64 on the CPU, so every device gets the same matrix."""
    generator = torch.Generator().manual_seed(seed)
    if rotation == "hadamard":
        signs = torch.randint(0, 2, (width,), generator=generator, dtype=torch.float64) * 2 - 1
        matrix = hadamard(width) * signs / math.sqrt(width)
    elif rotation == "random":
        q, r = torch.linalg.qr(torch.randn(width, width, generator=generator, dtype=torch.float64))
        matrix = q * torch.sign(torch.diagonal(r))
    elif rotation == "none":
        matrix = torch.eye(width, dtype=torch.float64)
    else:
        raise ValueError(f"unknown rotation {rotation!r}; accepted: {', '.join(ROTATIONS)}")
    return matrix.to(device=device, dtype=torch.float32)


@attrs.frozen
class RotatedTokenQuantizer(Quantizer):
    """Rotate each vector by a fixed orthogonal ``Q``, then ``bits``-bit codes per ``group`` channels."""

    head_sharding: ClassVar[str] = "head-local"
    packed_formats: ClassVar[tuple[str, ...]] = ("rotated-token.v1", "rotated-token-log8.v1", "rotated-token-tiled.v1",
                                                 "rotated-token-log8-tiled.v1")

    @property
    def packed_format(self) -> str:  # type: ignore[override]
        return self.packed_formats[(self.scale_format == "log8") + 2 * bool(self.token_tiles)]

    bits: int = attrs.field(default=2, validator=_bits, metadata={"doc": "bits per code (2, 3 or 4)"})
    group: int = attrs.field(
        default=64, validator=integer(1, 1 << 16), metadata={"doc": "rotated channels per scale (min(group, width))"}
    )
    rotation: str = attrs.field(
        default="hadamard", validator=choice(ROTATIONS),
        metadata={"doc": "'hadamard' (power-of-two widths), 'random' orthogonal, or 'none' (plain per-token groups)"},
    )
    seed: int = attrs.field(default=0, validator=integer(0, (1 << 63) - 1), metadata={"doc": "seed of the signs / Gaussian of Q"})
    symmetric: bool = attrs.field(
        default=True, validator=_flag,
        metadata={"doc": "one float16 scale per group (true), or a scale and a zero point: minimum or mean (false)"},
    )
    levels: str = attrs.field(
        default="normal", validator=choice(LEVELS),
        metadata={"doc": "'normal' (Lloyd-Max levels of N(0, 1) times the group's RMS) or 'uniform' steps"},
    )
    scale_format: str = attrs.field(
        default="float16", validator=choice(SCALE_FORMATS),
        metadata={"doc": "'float16' scales, or 'log8': one byte per scale, 2**(-k/16) below a float16 maximum per scale_tokens tokens"},
    )
    scale_tokens: int = attrs.field(
        default=64, validator=integer(1, 1 << 16),
        metadata={"doc": "log8: tokens whose scales share one float16 maximum (must divide the pipeline's block_tokens)"},
    )
    layer_bits: tuple[int, ...] = attrs.field(
        default=(), converter=layer_table, validator=each_entry(_bits, "bits"),
        metadata={"doc": "bits per layer, one entry per layer of the model (empty: 'bits' for every layer)"},
    )
    layer_levels: tuple[str, ...] = attrs.field(
        default=(), converter=name_table, validator=each_entry(choice(LEVELS), "levels"),
        metadata={"doc": "levels per layer ('normal' or 'uniform'), one entry per layer of the model (empty: 'levels' "
                         "for every layer); e.g. uniform where layer_bits gives 4 bits, which the dense kernel reads "
                         "without a table"},
    )
    token_tiles: int = attrs.field(
        default=0, validator=choice(TOKEN_TILES),
        metadata={"doc": "0: codes token by token; 64: 2- or 4-bit codes in tiles of 64 tokens, channel by channel (the lowbit "
                         "kernel's dense variant reads them without a trip through shared memory)"},
    )

    def __attrs_post_init__(self) -> None:
        widths = sorted(set(self.layer_bits)) if self.layer_bits else [self.bits]
        if self.token_tiles and 3 in widths:
            raise ValueError(f"rotated-token token_tiles = {self.token_tiles} stores 2- or 4-bit codes (a width per "
                             f"layer among them); got bits {widths}")
        if self.layer_bits and self.layer_levels and len(self.layer_bits) != len(self.layer_levels):
            raise ValueError(f"rotated-token layer_bits ({len(self.layer_bits)} entries) and layer_levels "
                             f"({len(self.layer_levels)} entries) must have one entry per layer each")

    def check_model(self, shape: ModelShape) -> None:
        check_table(self.layer_bits, shape.num_layers, "rotated-token")
        check_table(self.layer_levels, shape.num_layers, "rotated-token", "layer_levels")

    def for_layer(self, layer: int) -> RotatedTokenQuantizer:
        if not (self.layer_bits or self.layer_levels):
            return self
        bits = int(self.layer_bits[layer]) if self.layer_bits else self.bits
        levels = self.layer_levels[layer] if self.layer_levels else self.levels
        return attrs.evolve(self, bits=bits, levels=levels, layer_bits=(), layer_levels=())

    def _group_for(self, width: int) -> int:
        return min(self.group, width)

    def check_width(self, width: int, where: str) -> None:
        codes = chunk_codes(self.bits)
        group = self._group_for(width)
        if width % codes or width % group:
            raise ModelError(
                f"{where}: rotated-token needs a width divisible by group={self.group} and by {codes} "
                f"({self.bits}-bit codes pack {codes} at a time), got width {width}"
            )
        if self.rotation == "hadamard" and width & (width - 1):
            raise ModelError(
                f"{where}: rotated-token rotation 'hadamard' needs a power-of-two width, got {width}; "
                "use rotation = 'random' for other widths"
            )

    def _matrix(self, width: int, device: torch.device) -> torch.Tensor:
        return rotation_matrix(self.rotation, self.seed, width, str(device))

    def rotation_for(self, width: int, device: torch.device) -> torch.Tensor:
        """``Q`` [C, C] float32: a stored vector restores as ``(level * scale (+ zero)) @ Q`` (for kernels that
        sum in the rotated space and rotate back once)."""
        return self._matrix(width, device).float().contiguous()

    def level_table(self) -> tuple[float, ...]:
        """The value of each code before its scale: the normal levels, the mid-rise levels (uniform,
        symmetric), or the code itself (uniform, asymmetric: ``zero`` is added)."""
        count = 1 << self.bits
        if self.levels == "normal":
            return normal_levels(self.bits)
        if self.symmetric:
            return tuple(code - (count - 1) / 2 for code in range(count))
        return tuple(float(code) for code in range(count))

    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        width = x.shape[-1]
        self.check_width(width, "rotated-token.quantize")
        group = self._group_for(width)
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        rotated = x.to(work) @ self._matrix(width, x.device).to(work).T
        grouped = rotated.float().reshape(*x.shape[:-1], width // group, group)
        check_magnitude(
            "rotated-token", torch.linalg.vector_norm(grouped, float("inf"), dim=-1), FLOAT16_MAX,  # abs().amax() in one pass
            "the largest float16, for the elements of the rotated vectors: their float16 scales and zero points "
            "hold that range",
            source=rotated,
        )
        if self.levels == "normal":
            center, spread, fields = self._normal(grouped)
            if pack_kernels.fused(x):  # codes (and, token by token, their packing) in one kernel
                edges = normal_edges(self.bits)
                if not self.token_tiles:
                    return {"codes": pack_kernels.nearest_levels(rotated.float(), spread, fields.get("zero"), edges, self.bits),
                            **fields}
                codes = pack_kernels.nearest_level_codes(rotated.float(), spread, fields.get("zero"), edges, self.bits)
            else:
                codes = nearest_level_codes(grouped, center.unsqueeze(-1), spread.unsqueeze(-1), self.bits)
        else:
            codes, fields = self._uniform(grouped)
        codes = codes.clamp_(0, (1 << self.bits) - 1).reshape(*x.shape[:-1], width)
        if self.token_tiles:
            if x.dim() < 2 or x.shape[-2] % self.token_tiles:
                raise ModelError(f"rotated-token token_tiles = {self.token_tiles} stores whole tiles of tokens; got "
                                 f"{x.shape[-2] if x.dim() > 1 else 1} tokens, not a multiple of it")
            codes = tile_codes(codes, self.bits)
        return {"codes": pack(codes, self.bits), **fields}

    def _normal(self, grouped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """Each group's center and spread [..., groups] float32 as stored (the levels are ``center + spread * level``)
        and their fields."""
        fields = {}
        center = torch.zeros_like(grouped[..., 0])
        if not self.symmetric:
            fields["zero"] = grouped.mean(dim=-1).to(torch.float16)
            center = fields["zero"].float()
        centered = grouped if self.symmetric else grouped - center.unsqueeze(-1)  # a center of 0 subtracts nothing
        scale, stored = self._stored_scale(centered.square().mean(dim=-1).sqrt(), up=False)
        return center, scale, {**stored, **fields}

    def _uniform(self, grouped: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self.symmetric:
            scale, stored = self._stored_scale(midrise_scale(grouped.abs().amax(dim=-1), self.bits).float(), up=True)
            codes = torch.round(grouped / safe_step(scale).unsqueeze(-1) + ((1 << self.bits) - 1) / 2)
            return codes, stored
        zero, scale = affine_range(grouped.amin(dim=-1), grouped.amax(dim=-1), self.bits)
        scale, stored = self._stored_scale(scale.float(), up=True)
        codes = torch.round((grouped - zero.float().unsqueeze(-1)) / safe_step(scale).unsqueeze(-1))
        return codes, {**stored, "zero": zero}

    def _stored_scale(self, wanted: torch.Tensor, up: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The scales as stored (float32, what the codes are taken against) and their fields. ``wanted`` [..., n,
        groups] float32; ``up``: never store less than wanted (a range that must stay covered). float16: the
        scale itself (rounded up by the caller where that matters). log8: ``scale_max`` float16 [..., n / scale_tokens,
        groups] (the largest scale of each scale_tokens tokens, rounded up) and ``scale_log`` uint8 [..., n, groups], ``k``
        for ``scale_max * 2**(-k / 16)``, to nearest or rounded toward the larger scale with ``up``."""
        if self.scale_format == "float16":
            scale = wanted.to(torch.float16)
            return scale.float(), {"scale": scale}
        tokens, span = wanted.shape[-2], self.scale_tokens
        if tokens % span:
            raise ModelError(f"rotated-token scale_format 'log8' shares one maximum among every {span} tokens (scale_tokens); "
                             f"got {tokens} tokens, not a multiple of it")
        top = wanted.unflatten(-2, (tokens // span, span)).amax(dim=-2)  # [..., n / span, groups]
        half = top.to(torch.float16)  # rounded up where nearest fell short, so that it is >= every scale
        top = torch.where(half.float() < top, (top * (1 + 2**-10)).clamp(max=65504.0).to(torch.float16), half)
        steps = torch.log2(top.float().repeat_interleave(span, dim=-2) / wanted.clamp_min(1e-30)) * LOG8_STEPS
        steps = torch.floor(steps + 1e-4) if up else torch.round(steps)
        log = steps.clamp_(0, 255).to(torch.uint8)
        return self._log8_scale(top, log), {"scale_max": top, "scale_log": log}

    def _log8_scale(self, top: torch.Tensor, log: torch.Tensor) -> torch.Tensor:
        return top.float().repeat_interleave(self.scale_tokens, dim=-2) * torch.exp2(-log.float() / LOG8_STEPS)

    def tokens_per_group(self) -> int:
        return math.lcm(self.scale_tokens if self.scale_format == "log8" else 1, self.token_tiles or 1)

    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack(packed["codes"], self.bits)
        if self.token_tiles:
            codes = untile_codes(codes, self.bits)
        if "scale_log" in packed:
            scale = self._log8_scale(packed["scale_max"], packed["scale_log"]).unsqueeze(-1)
        else:
            scale = packed["scale"].float().unsqueeze(-1)
        if self.levels == "normal":
            values = level_table(self.bits, str(codes.device))[codes]
        elif self.symmetric:
            values = codes.float() - ((1 << self.bits) - 1) / 2
        else:
            values = codes.float()
        rotated = values.reshape(*scale.shape[:-1], -1) * scale
        if not self.symmetric:
            rotated = rotated + packed["zero"].float().unsqueeze(-1)
        rotated = rotated.reshape(codes.shape)
        work = torch.float64 if dtype == torch.float64 else torch.float32
        return (rotated.to(work) @ self._matrix(codes.shape[-1], codes.device).to(work)).to(dtype)

    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        groups = width // self._group_for(width)
        scale = 2 if self.scale_format == "float16" else 1 + 2 / self.scale_tokens  # log8: a byte, and a share of a float16 maximum
        return width * self.bits / 8 + groups * (scale + (0 if self.symmetric else 2))


@hookimpl
def kvweave_register_quantizers(registrar) -> None:
    registrar.add("rotated-token", RotatedTokenQuantizer)
