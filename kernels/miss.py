"""A block's difference from its reconstruction and each token's relative miss, by one Triton kernel
(:mod:`kvweave.kernels.miss_triton`) where torch makes three passes: the subtraction (reading the block and its float32
reconstruction, writing the difference), the difference's norms (reading it again) and the block's norms (reading the
block again). A prompt's flush runs it once per kind and basis group (docs/kernels.md "A block's misses in one pass, residual coordinates selected rank-major").

:func:`block_miss_torch` is the twin the tests compare the kernel with, and the encoder's path where the kernel does
not run (a CPU, or ``KVWEAVE_FUSED_MISS=0``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvweave.core.environment import env_switch
from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.launch import Launch

if TYPE_CHECKING:
    from kvweave.kernels import miss_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.miss_triton")

#: tokens a program reads per launch
TOKEN_TILE = 32

#: the encoder's misses by :func:`block_miss` on a CUDA GPU where Triton is installed (KVWEAVE_FUSED_MISS=0: by
#: :func:`block_miss_torch`, to time both in one run)
FUSED_MISS = env_switch("KVWEAVE_FUSED_MISS")


def miss_kernel_available() -> bool:
    """Whether Triton is installed (the kernel's module defines it)."""
    return jit.triton is not None


def block_miss_torch(source: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(difference, miss)``: ``source - approx`` in float32 [..., n, D] and each token's ``|difference| /
    max(|source|, 1e-9)`` [..., n] (``source`` in any float dtype, ``approx`` float32, the same shape)."""
    difference = torch.sub(source, approx)
    size = torch.linalg.vector_norm(source, dim=-1, dtype=torch.float32).clamp_min(1e-9)
    return difference, difference.norm(dim=-1) / size


def misses(source: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's ``(difference, miss)``: by :func:`block_miss` for CUDA tensors (a float32 reconstruction, Triton
    installed, :data:`FUSED_MISS` on), else by :func:`block_miss_torch`."""
    if FUSED_MISS and source.is_cuda and approx.dtype == torch.float32 and source.shape == approx.shape and miss_kernel_available():
        return block_miss(source, approx)
    return block_miss_torch(source, approx)


def block_miss(source: torch.Tensor, approx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_miss_torch`'s ``(difference, miss)`` from one kernel: ``source`` [..., n, D] (16-bit or float32,
    read as it lies where its leading axes flatten to one), ``approx`` float32 of the same shape. A GPU, or CPU tensors
    in Triton's interpreter (TRITON_INTERPRET=1)."""
    return plan_miss(source, approx).run()  # type: ignore[return-value]


def plan_miss(source: torch.Tensor, approx: torch.Tensor) -> Launch:
    """The launch :func:`block_miss` makes (one program per leading row and tile of :data:`TOKEN_TILE` tokens)."""
    if jit.triton is None:
        raise RuntimeError("the block miss kernel needs Triton")
    if source.shape != approx.shape or source.dim() < 2:
        raise ValueError(f"block_miss takes a block and its reconstruction of one shape [..., n, D], got "
                         f"{tuple(source.shape)} and {tuple(approx.shape)}")
    if approx.dtype != torch.float32 or not source.is_floating_point():
        raise ValueError(f"block_miss takes a floating block and a float32 reconstruction, got {source.dtype} and {approx.dtype}")
    if source.device != approx.device:
        raise ValueError(f"block_miss: the block is on {source.device}, its reconstruction on {approx.device}")
    *lead, tokens, dim = source.shape
    flat_source, flat_approx = _rows(source, tokens, dim), _rows(approx, tokens, dim)
    outer = flat_source.shape[0]
    difference = torch.empty(*lead, tokens, dim, dtype=torch.float32, device=source.device)
    miss = torch.empty(*lead, tokens, dtype=torch.float32, device=source.device)
    args = (flat_source, flat_approx, difference, miss, tokens, flat_source.stride(0), flat_source.stride(1),
            flat_approx.stride(0), flat_approx.stride(1))
    constants = dict(D=dim, BD=1 << (dim - 1).bit_length(), TB=TOKEN_TILE)
    return Launch(jit._block_miss_kernel, (outer, max(1, -(-tokens // TOKEN_TILE))), args, constants, (difference, miss))


def _rows(tensor: torch.Tensor, tokens: int, dim: int) -> torch.Tensor:
    """``tensor`` [..., n, D] as [O, n, D] with channels side by side: a view where its leading axes flatten to one
    (a block cut to its first tokens does), else a contiguous copy."""
    if tensor.stride(-1) != 1:
        tensor = tensor.contiguous()
    return tensor.reshape(-1, tokens, dim)
