"""A flushed block's codes computed and packed by one Triton kernel (:mod:`kvweave.kernels.pack_triton`) instead of the
quantizers' dozen torch passes over the block: the time to first token of a compressing cache is the prompt's forward
plus the prompt's compression, where each pass reads and writes the whole prompt's keys or values (docs/kernels.md,
"The prompt's compression in fewer passes").

The arithmetic is the quantizers' own (their torch paths are the twins the tests compare with, bit for bit):

- :func:`affine_varwidth` (``channel-alloc``): per channel of each group of tokens a float16 zero point and scale and a
  width; code ``round((x - zero) / step)`` (half to even, ``step`` the scale or 1 where it is 0) clamped to ``0 ..
  2**width - 1``, 0 at a token's outlier channels, packed as one little-endian stream per token
  (:func:`kvweave.kernels.formats.unpack_varwidth` reads it).
- :func:`nearest_levels` (``rotated-token``, normal levels): the number of cell edges ``center + spread * edge`` below
  each element, packed ``bits`` a code (:func:`kvweave.kernels.formats.unpack_codes` reads it); :func:`nearest_level_codes`
  the same codes a byte each, for values stored in tiles of tokens (tiled and packed by torch on bytes).

A quantizer takes the kernel where :func:`fused` says so: on a CUDA device with Triton, or anywhere when
:data:`FORCE` is set (the tests run the kernels in Triton's interpreter that way).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.launch import Launch

if TYPE_CHECKING:
    from kvweave.kernels import pack_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.pack_triton")

#: tokens a program packs (a product's rows: 16 at least)
TOKEN_TILE = 16
#: None: the kernels on CUDA tensors where Triton is installed; True / False: always / never (tests)
FORCE: bool | None = None


def fused(x: torch.Tensor) -> bool:
    """Whether a quantizer packs ``x``'s codes with these kernels."""
    if FORCE is not None:
        return FORCE
    return x.is_cuda and jit.triton is not None


@functools.lru_cache(maxsize=32)
def _edge_table(edges: tuple[float, ...], device: str) -> torch.Tensor:
    return torch.tensor(edges, dtype=torch.float32, device=device)


def _tile(width: int) -> int:
    """A product's side holding ``width`` channels: a power of two, 16 at least."""
    return max(16, 1 << (width - 1).bit_length())


def _bytes_tile(size: int) -> int:
    return max(16, 1 << size.bit_length())  # a slot past the last byte: a code's high part ends there


#: the most elements of a one-hot [channels, bytes] operand a kernel makes at once (float16, twice: a code's low and
#: high parts): 128 channels into 256 byte slots. Whole at head_dim 256, 4 bits a code, the two took 256 KiB of shared
#: memory, past an H100's 227 KiB, and the kernel could not launch (2026-12-06); the channels go in parts beyond it
ONE_HOT_ELEMENTS = 128 * 256


def _channel_part(channels: int, slots: int) -> int:
    """The channels a packing kernel takes at once: all ``channels`` (a power of two) where the one-hot operand of
    ``slots`` byte slots stays within :data:`ONE_HOT_ELEMENTS`, else the largest power of two that does (16 at least)."""
    part = channels
    while part > 16 and part * slots > ONE_HOT_ELEMENTS:
        part //= 2
    return part


def affine_varwidth(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: torch.Tensor, total: int,
                    outliers: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., n, C] (any float dtype), ``zero`` / ``scale`` float16 and ``bits`` (integer widths) [..., n / group, C],
    ``outliers`` uint8 [..., n, k] or None -> uint8 [..., n, total / 8] (``total`` the bits a token's widths sum to)."""
    launch = plan_affine_varwidth(x, zero, scale, bits, total, outliers)
    return launch.run()[0] if launch.outputs[0].numel() else launch.outputs[0]


def plan_affine_varwidth(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, bits: torch.Tensor, total: int,
                         outliers: torch.Tensor | None = None) -> Launch:
    """The launch :func:`affine_varwidth` makes (one program per tile of 16 tokens)."""
    if jit.triton is None:
        raise RuntimeError("the packing kernels need Triton")
    *lead, tokens, width = x.shape
    rows = zero.shape[-2] if zero.dim() > 1 else 0
    if not rows or zero.shape != (*lead, rows, width) or scale.shape != zero.shape or bits.shape != zero.shape or tokens % rows:
        raise ValueError(f"affine_varwidth: x {tuple(x.shape)} takes zero points, scales and widths [..., n / group, C], "
                         f"got {tuple(zero.shape)}, {tuple(scale.shape)}, {tuple(bits.shape)}")
    group = tokens // rows
    if group % TOKEN_TILE or total % 8:
        raise ValueError(f"affine_varwidth: groups of {group} tokens (a multiple of {TOKEN_TILE}) and {total} bits a token "
                         "(whole bytes) are needed")
    count = 0 if outliers is None else outliers.shape[-1]
    if outliers is not None and (outliers.shape != (*lead, tokens, count) or outliers.dtype != torch.uint8):
        raise ValueError(f"affine_varwidth: outlier channels must be uint8 [..., n, k] for x {tuple(x.shape)}, got "
                         f"{tuple(outliers.shape)} {outliers.dtype}")
    if zero.dtype != torch.float16 or scale.dtype != torch.float16:
        raise ValueError(f"affine_varwidth: zero points and scales are float16, got {zero.dtype} and {scale.dtype}")
    size = total // 8
    out = torch.empty(*lead, tokens, size, dtype=torch.uint8, device=x.device)
    flat = x.reshape(-1, width).contiguous()
    args = (flat, zero.contiguous(), scale.contiguous(), bits.to(torch.uint8).contiguous(),
            out if outliers is None else outliers.contiguous(), out)
    constants = dict(C=width, BC=_tile(width), GROUP=group, BT=TOKEN_TILE, K=count, NB=size,
                     BNB=_bytes_tile(size), CB=_channel_part(_tile(width), _bytes_tile(size)))
    return Launch(jit._affine_varwidth_kernel, (flat.shape[0] // TOKEN_TILE,), args, constants, (out,))


def nearest_levels(y: torch.Tensor, spread: torch.Tensor, center: torch.Tensor | None, edges: tuple[float, ...],
                   bits: int) -> torch.Tensor:
    """``y`` [..., C] float32, ``spread`` (and ``center`` or None for 0) float32 [..., C / width] for groups of
    ``width`` channels, ``edges`` the ``2**bits - 1`` ascending cell edges -> uint8 [..., C * bits / 8]."""
    launch = plan_nearest_levels(y, spread, center, edges, bits)
    return launch.run()[0] if launch.outputs[0].numel() else launch.outputs[0]


def nearest_level_codes(y: torch.Tensor, spread: torch.Tensor, center: torch.Tensor | None, edges: tuple[float, ...],
                        bits: int) -> torch.Tensor:
    """The codes :func:`nearest_levels` packs, a code a byte: uint8 [..., C] (for a layout packed after them, values in
    tiles of tokens)."""
    launch = plan_nearest_levels(y, spread, center, edges, bits, raw=True)
    return launch.run()[0] if launch.outputs[0].numel() else launch.outputs[0]


def plan_nearest_levels(y: torch.Tensor, spread: torch.Tensor, center: torch.Tensor | None, edges: tuple[float, ...],
                        bits: int, raw: bool = False) -> Launch:
    """The launch :func:`nearest_levels` makes (one program per tile of 16 tokens); ``raw``: a code a byte."""
    if jit.triton is None:
        raise RuntimeError("the packing kernels need Triton")
    width, groups = y.shape[-1], spread.shape[-1]
    if (y.dtype != torch.float32 or spread.shape != (*y.shape[:-1], groups) or width % groups
            or (center is not None and center.shape != spread.shape) or len(edges) != (1 << bits) - 1
            or (width * bits) % 8):
        raise ValueError(f"nearest_levels: y float32 [..., C] {tuple(y.shape)} {y.dtype} takes spreads [..., groups] "
                         f"dividing C, {(1 << bits) - 1} edges for {bits} bits and whole bytes; got {tuple(spread.shape)}, "
                         f"{len(edges)} edges")
    flat = y.reshape(-1, width).contiguous()
    size = width * bits // 8
    out = torch.empty(*y.shape[:-1], width if raw else size, dtype=torch.uint8, device=y.device)
    spread = spread.float().contiguous()
    args = (flat, spread if center is None else center.float().contiguous(), spread,
            _edge_table(tuple(edges), str(y.device)), out, flat.shape[0])
    constants = dict(C=width, BC=_tile(width), WIDTH=width // groups, BT=TOKEN_TILE, BITS=bits,
                     CENTERED=center is not None, NB=size, BNB=_bytes_tile(size), RAW=raw,
                     CB=_tile(width) if raw else _channel_part(_tile(width), _bytes_tile(size)),
                     enable_fp_fusion=False)  # each edge as torch makes it: a product rounded, then a sum
    return Launch(jit._nearest_level_kernel, (max(1, -(-flat.shape[0] // TOKEN_TILE)),), args, constants, (out,))
