"""One decode token appended to an int8 exact window (:class:`kvweave.engine.exact.ExactTokens`, ``window_storage =
"int8"``) and the window read back for that step's attention, by one Triton kernel per kind
(:mod:`kvweave.kernels.window_triton`) instead of the ~25 small torch operations of encoding, concatenating and
dequantizing: on a GPU a decode step is bound by the host's launches where the batch is small (docs/kernels.md).

The arithmetic is ExactTokens' own (its torch path is the twin the tests compare with): scale ``absmax / 127``
rounded to float16, codes ``round(x / scale)`` (half to even) clamped to +-127, a vector holding NaN or infinity
stored with a NaN scale; read back as code x scale in float32, rounded to the tokens' dtype, the new token as it
arrived.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvweave.core.lazy import lazy_module, torch
from kvweave.kernels.launch import Launch

if TYPE_CHECKING:
    from kvweave.kernels import window_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.window_triton")

#: stored tokens a program copies per loop step
TOKEN_TILE = 16


def encode_int8(tokens: torch.Tensor, worst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's ``tokens`` [B, H, n, D] as an int8 window holds them, in one pass: codes int8 [B, H, n, D] and scales
    float16 [B, H, n, 1], each token as :func:`append_int8` encodes one; ``worst`` float32 [1] raised to their largest
    finite magnitude."""
    return plan_encode(tokens, worst).run()  # type: ignore[return-value]


def plan_encode(tokens: torch.Tensor, worst: torch.Tensor) -> Launch:
    """The launch :func:`encode_int8` makes (one program per batch row, head and tile of 16 tokens)."""
    if jit.triton is None:
        raise RuntimeError("the int8 window's encode kernel needs Triton")
    if tokens.dim() != 4 or worst.dtype != torch.float32 or worst.numel() != 1:
        raise ValueError(f"encode_int8 takes tokens [B, H, n, D] and a float32 [1] maximum, got {tuple(tokens.shape)}, "
                         f"{worst.dtype} {tuple(worst.shape)}")
    if tokens.stride(-1) != 1:  # the kernel reads a token's channels side by side
        tokens = tokens.contiguous()
    batch, heads, count, dim = tokens.shape
    codes = torch.empty(batch, heads, count, dim, dtype=torch.int8, device=tokens.device)
    scale = torch.empty(batch, heads, count, 1, dtype=torch.float16, device=tokens.device)
    args = (tokens, codes, scale, worst, heads, count, tokens.stride(0), tokens.stride(1), tokens.stride(2))
    constants = dict(D=dim, BD=1 << (dim - 1).bit_length(), TB=TOKEN_TILE)
    return Launch(jit._window_encode_kernel, (batch * heads, max(1, -(-count // TOKEN_TILE))), args, constants, (codes, scale))


def append_int8(codes: torch.Tensor, scale: torch.Tensor, new: torch.Tensor,
                worst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``codes`` int8 [B, H, n, D] and ``scale`` float16 [B, H, n, 1] with ``new`` [B, H, 1, D] appended: the
    window's new codes and scales (n + 1 tokens) and the window read back in ``new``'s dtype [B, H, n + 1, D]
    (``new`` exact at its own position). ``worst`` float32 [1] on the same device is raised to the new token's
    largest finite magnitude (a vector with NaN or infinity counts 0)."""
    return plan_append(codes, scale, new, worst).run()  # type: ignore[return-value]


def plan_append(codes: torch.Tensor, scale: torch.Tensor, new: torch.Tensor, worst: torch.Tensor) -> Launch:
    """The launch :func:`append_int8` makes (one program per batch row and head)."""
    if jit.triton is None:
        raise RuntimeError("the int8 window's append kernel needs Triton")
    batch, heads, held, dim = codes.shape
    if new.shape != (batch, heads, 1, dim) or scale.shape != (batch, heads, held, 1):
        raise ValueError(f"append_int8: a window of {tuple(codes.shape)} codes, {tuple(scale.shape)} scales takes one "
                         f"token [B, H, 1, D] of the same B, H, D; got {tuple(new.shape)}")
    if codes.dtype != torch.int8 or scale.dtype != torch.float16 or worst.dtype != torch.float32 or worst.numel() != 1:
        raise ValueError("append_int8 takes int8 codes, float16 scales and a float32 [1] maximum")
    rows = new.reshape(batch * heads, dim)
    if rows.stride(-1) != 1:  # the kernel reads a token's channels side by side
        rows = rows.contiguous()
    out_codes = codes.new_empty(batch, heads, held + 1, dim)
    out_scale = scale.new_empty(batch, heads, held + 1, 1)
    read = new.new_empty(batch, heads, held + 1, dim)
    args = (codes.contiguous(), scale.contiguous(), rows, out_codes, out_scale, read, worst, held, rows.stride(0))
    constants = dict(D=dim, BD=1 << (dim - 1).bit_length(), TB=TOKEN_TILE)
    return Launch(jit._window_append_kernel, (batch * heads,), args, constants, (out_codes, out_scale, read))


def put_int8(codes: torch.Tensor, scale: torch.Tensor, read: torch.Tensor, new: torch.Tensor, fill: torch.Tensor,
             worst: torch.Tensor) -> None:
    """``new`` [B, H, 1, D] written into a window kept in buffers of capacity C (``codes`` int8 [B, H, C, D], ``scale``
    float16 [B, H, C, 1], ``read`` [B, H, C, D] in ``new``'s dtype) at the index ``fill`` holds (int32 [1] on the same
    device: the tokens held before it), by one kernel whose launch is the same at every step (a CUDA graph replays it):
    its codes and scale as :func:`append_int8` makes them, itself in ``read`` as it arrived, and the token before it
    in ``read`` replaced by that token's read-back. ``worst`` as in :func:`append_int8`. The caller keeps ``fill`` below
    C and advances it after the step."""
    plan_put(codes, scale, read, new, fill, worst).run()


def plan_put(codes: torch.Tensor, scale: torch.Tensor, read: torch.Tensor, new: torch.Tensor, fill: torch.Tensor,
             worst: torch.Tensor) -> Launch:
    """The launch :func:`put_int8` makes (one program per batch row and head)."""
    if jit.triton is None:
        raise RuntimeError("the int8 window's put kernel needs Triton")
    batch, heads, capacity, dim = codes.shape
    if (new.shape != (batch, heads, 1, dim) or scale.shape != (batch, heads, capacity, 1) or read.shape != codes.shape
            or fill.shape != (1,)):
        raise ValueError(f"put_int8: buffers of {tuple(codes.shape)} codes, {tuple(scale.shape)} scales, {tuple(read.shape)} "
                         f"read-back and a [1] fill take one token [B, H, 1, D] of the same B, H, D; got {tuple(new.shape)}, "
                         f"fill {tuple(fill.shape)}")
    if (codes.dtype != torch.int8 or scale.dtype != torch.float16 or fill.dtype != torch.int32 or read.dtype != new.dtype
            or worst.dtype != torch.float32 or worst.numel() != 1):
        raise ValueError("put_int8 takes int8 codes, float16 scales, a read-back in the token's dtype, an int32 fill and a "
                         "float32 [1] maximum")
    if not (codes.is_contiguous() and scale.is_contiguous() and read.is_contiguous()):
        raise ValueError("put_int8 writes into contiguous buffers")
    rows = new.reshape(batch * heads, dim)
    if rows.stride(-1) != 1:  # the kernel reads a token's channels side by side
        rows = rows.contiguous()
    args = (codes, scale, read, rows, fill, worst, capacity, rows.stride(0))
    constants = dict(D=dim, BD=1 << (dim - 1).bit_length())
    return Launch(jit._window_put_kernel, (batch * heads,), args, constants, (codes, scale, read))
