"""Shared helpers of the low-bit quantizers (``channel-group``, ``rotated-token``): dense bit packing,
float16 affine/symmetric ranges that keep every element within half a stored step (the scales rounded up,
subnormal ones too, and the codes computed with the stored scale: :func:`safe_step`), and the Lloyd-Max
levels of a normal distribution (Max, "Quantizing for minimum distortion", IRE Trans. IT 1960) for the
non-uniform ``levels = "normal"``.

Bit layout (:func:`pack`): the codes of one vector form a little-endian bit stream, code ``i`` taking bits
``i * bits .. (i + 1) * bits - 1`` of the byte string (bit 0 is the least significant bit of byte 0).
A chunk of ``8 / gcd(bits, 8)`` codes fills ``bits / gcd(bits, 8)`` bytes exactly: 2-bit codes go 4 to a
byte, 4-bit codes 2 to a byte, 3-bit codes 8 to 3 bytes (code ``j`` of a chunk at bits ``3j .. 3j + 2``
of the chunk's 24-bit little-endian word). For 2, 4 and 8 bits this is the same layout as ``kivi``'s
(code ``j`` of each byte at bits ``j * bits``).
"""

from __future__ import annotations

import functools
import math

from kvweave.core.lazy import torch


def chunk_codes(bits: int) -> int:
    """Codes per packed chunk: a vector's width must be a multiple of it (8 for 3 bits, 4 for 2, 2 for 4)."""
    return 8 // math.gcd(bits, 8)


def _check(bits: int, width: int) -> tuple[int, int]:
    if not 1 <= bits <= 8:
        raise ValueError(f"bit packing takes 1 to 8 bits per code, got {bits}")
    codes = chunk_codes(bits)
    if width % codes:
        raise ValueError(f"{bits}-bit packing needs a width that is a multiple of {codes}, got {width}")
    return codes, codes * bits // 8


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Integer codes [..., C] in ``0 .. 2**bits - 1`` -> uint8 [..., C * bits / 8] (layout above)."""
    per_chunk, chunk_bytes = _check(bits, codes.shape[-1])
    if chunk_bytes == 1:  # 1, 2, 4 or 8 bits: a byte's codes shifted and summed in bytes (disjoint bits: the sum is the or)
        grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per_chunk, per_chunk)
        shifts = torch.arange(0, 8, bits, device=codes.device, dtype=torch.uint8)
        return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)
    grouped = codes.to(torch.int64).reshape(*codes.shape[:-1], codes.shape[-1] // per_chunk, per_chunk)
    shifts = torch.arange(per_chunk, device=codes.device, dtype=torch.int64) * bits
    words = (grouped << shifts).sum(dim=-1, keepdim=True)  # disjoint bits: the sum is the bitwise or
    byte_shifts = torch.arange(chunk_bytes, device=codes.device, dtype=torch.int64) * 8
    out = (words >> byte_shifts) & 0xFF
    return out.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] * bits // 8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., C * bits / 8] -> int64 codes [..., C] (inverse of :func:`pack`)."""
    per_chunk = chunk_codes(bits)
    chunk_bytes = per_chunk * bits // 8
    if packed.shape[-1] % chunk_bytes:
        raise ValueError(f"{bits}-bit codes come in chunks of {chunk_bytes} bytes; got {packed.shape[-1]} bytes")
    grouped = packed.to(torch.int64).reshape(*packed.shape[:-1], packed.shape[-1] // chunk_bytes, chunk_bytes)
    byte_shifts = torch.arange(chunk_bytes, device=packed.device, dtype=torch.int64) * 8
    words = (grouped << byte_shifts).sum(dim=-1, keepdim=True)
    shifts = torch.arange(per_chunk, device=packed.device, dtype=torch.int64) * bits
    codes = (words >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] // chunk_bytes * per_chunk)


def _down(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """float16 ``value`` moved one float16 step down where it lies above ``target`` (float32)."""
    return torch.where(value.float() > target, torch.nextafter(value, torch.full_like(value, -math.inf)), value)


def _up(value: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.where(value.float() < target, torch.nextafter(value, torch.full_like(value, math.inf)), value)


def affine_range(low: torch.Tensor, high: torch.Tensor, bits: int | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 ``(zero, scale)`` with ``zero <= low`` and ``zero + (2**bits - 1) * scale >= high``, so codes
    ``round((x - zero) / scale)`` of any ``x`` in [low, high] are off by at most ``scale / 2``.

    ``low``/``high`` float32 of any shape, within float16's range (``-65504 <= low``; callers refuse inputs
    beyond it). The scale is rounded up in float16's subnormal range too (steps of ``2**-24``), so it is
    never below ``(high - zero) / levels`` and no code of the range needs clamping. A scale of zero (a
    constant range that float16 holds exactly) is kept: encode with :func:`safe_step`. ``bits`` may be a
    tensor of widths >= 1 broadcastable to ``low`` (one per channel)."""
    levels = (1 << bits) - 1 if isinstance(bits, int) else ((1 << bits.long()) - 1).float()
    zero = _down(low.to(torch.float16), low)
    wanted = (high - zero.float()).clamp_min(0) / levels
    scale = _up(wanted.to(torch.float16), wanted)
    return zero, scale


def midrise_scale(absmax: torch.Tensor, bits: int) -> torch.Tensor:
    """float16 symmetric scale for the ``2**bits`` mid-rise levels ``(code - (2**bits - 1) / 2) * scale``
    (code ``0 .. 2**bits - 1``; for 2 bits: -1.5, -0.5, 0.5, 1.5 steps), rounded up so that the outermost
    level reaches ``absmax``: every ``|x| <= absmax`` is then within ``scale / 2`` of a level."""
    wanted = absmax.float() * 2 / ((1 << bits) - 1)
    return _up(wanted.to(torch.float16), wanted)


def safe_step(scale: torch.Tensor) -> torch.Tensor:
    """The step to encode with: the *stored* scale as float32 (subnormal float16 scales included, so the
    encoder divides by exactly the step the decoder multiplies by), a zero scale replaced by 1 to avoid
    dividing by zero. A zero scale comes only from a range of zero width (:func:`affine_range`,
    :func:`midrise_scale` round up), whose elements sit on the offset: their codes are the same whatever
    the step."""
    scale = scale.float()
    return torch.where(scale == 0, torch.ones_like(scale), scale)


@functools.lru_cache(maxsize=None)
def normal_levels(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max reconstruction levels of a standard normal (ascending): each level is the
    mean of the normal over its cell, cells split at the midpoints between levels (Max 1960; 2 bits:
    +-0.4528, +-1.5104)."""
    count = 1 << bits
    levels = torch.linspace(-2.0, 2.0, count, dtype=torch.float64)
    inf = torch.tensor([torch.inf], dtype=torch.float64)
    for _ in range(500):
        edges = torch.cat((-inf, (levels[1:] + levels[:-1]) / 2, inf))
        density = torch.exp(-edges.square() / 2) / math.sqrt(2 * math.pi)
        mass = torch.special.ndtr(edges[1:]) - torch.special.ndtr(edges[:-1])
        levels = (density[:-1] - density[1:]) / mass
    return tuple(float(level) for level in levels)


@functools.lru_cache(maxsize=32)
def level_table(bits: int, device: str) -> torch.Tensor:
    """:func:`normal_levels` as a float32 tensor on ``device``, made once (a table sent from the host at each call
    would stop the host for the GPU)."""
    return torch.tensor(normal_levels(bits), dtype=torch.float32, device=device)


def normal_edges(bits: int) -> tuple[float, ...]:
    """The ``2**bits - 1`` cell edges of :func:`normal_levels`: the midpoints between adjacent levels."""
    levels = normal_levels(bits)
    return tuple((below + above) / 2 for below, above in zip(levels[:-1], levels[1:]))


def nearest_level_codes(x: torch.Tensor, center: torch.Tensor, spread: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes (float, ``0 .. 2**bits - 1``) of the level ``center + spread * normal_levels(bits)[code]`` nearest
    to each element of ``x`` (``center``/``spread`` float32, broadcastable; pass the *stored* values): the
    number of cell edges (:func:`normal_edges`) below the element."""
    codes = torch.zeros_like(x)
    for edge in normal_edges(bits):
        codes += x > center + spread * edge
    return codes
