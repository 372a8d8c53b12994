"""Packed storage: named tensors that grow along a token axis, and the byte count of what is held.

Every tensor the compressed cache keeps lives in a :class:`Segment` (or a plain dict of tensors for
basis state), so :func:`tensor_bytes` over them is the cache's real memory: the ``nbytes`` of each
stored tensor, metadata (scales, indices) included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from kvweave.core.lazy import torch

if TYPE_CHECKING:
    TensorMap = dict[str, torch.Tensor]


def __getattr__(name: str) -> Any:
    # ``TensorMap`` names ``torch.Tensor``, so it is made when first imported (importing this module does
    # not import torch)
    if name == "TensorMap":
        return dict[str, torch.Tensor]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Sum of ``nbytes`` of distinct storages among ``tensors`` (views of one storage count once)."""
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def cat_tokens(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``old`` and ``new`` [..., T, k] joined along the token axis (dim -2), through 3-D views where their leading
    dimensions agree: CUDA's batched concatenation takes at most four dimensions and copied a five-dimensional
    store element by element (~0.25 s a flush for 57 GB of Llama-3-8B-shaped storage, docs/kernels.md)."""
    if old.dim() <= 3 or old.shape[:-2] != new.shape[:-2] or old.shape[-1] != new.shape[-1] or not (old.numel() and new.numel()):
        return torch.cat((old, new), dim=-2)  # torch's own checks and messages for what does not line up; empty parts
    joined = torch.cat((old.reshape(-1, *old.shape[-2:]), new.reshape(-1, *new.shape[-2:])), dim=-2)
    return joined.view(*old.shape[:-2], *joined.shape[-2:])


def stack_layers(parts: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """``torch.stack(parts)`` [G, ...] of same-shape tensors, by one copy a part into a new buffer: a layer's window
    tokens are token-major views (as the model's projections leave them), which ``torch.stack``'s concatenation kernel
    reads at about two thirds of the rate of a copy (a 32K group block on an H100: 496 against 357 us). One part: a
    view, no copy. ``dtype``: the buffer's, each part converted as it is copied (``torch.stack(parts).to(dtype)`` in
    one pass instead of two)."""
    dtype = parts[0].dtype if dtype is None else dtype
    if len(parts) == 1:
        return parts[0].unsqueeze(0).to(dtype)
    out = torch.empty((len(parts), *parts[0].shape), dtype=dtype, device=parts[0].device)
    for index, part in enumerate(parts):
        if part.shape != parts[0].shape or part.dtype != parts[0].dtype:
            raise ValueError(f"stack_layers: part {index} is {part.dtype} {tuple(part.shape)}, part 0 "
                             f"{parts[0].dtype} {tuple(parts[0].shape)}")
        out[index].copy_(part)
    return out


class Segment:
    """Named packed tensors sharing a token axis at dim -2 (``[..., T, k]``), appended block by block.

    A field may hold one row per group of tokens (e.g. KIVI's per-channel key scales, one row per 32
    tokens): its token axis is then ``T / stride``. The stride of each field is fixed by the first block
    (``tokens / rows``, the token count being the longest field's) and every later block must agree, so
    blocks concatenate row by row.
    """

    def __init__(self) -> None:
        self.fields: TensorMap = {}
        self.strides: dict[str, int] = {}
        self.tokens = 0

    def append(self, fields: TensorMap) -> None:
        lengths = {name: tensor.shape[-2] for name, tensor in fields.items()}
        tokens = max(lengths.values())
        strides = {name: tokens // length if length else 0 for name, length in lengths.items()}
        if any(length == 0 or length * strides[name] != tokens for name, length in lengths.items()):
            raise ValueError(f"packed fields disagree on the token count: {lengths} (a field may hold one row per group of tokens only when the group divides the count)")
        if self.fields and set(fields) != set(self.fields):
            raise ValueError(f"packed fields changed from {sorted(self.fields)} to {sorted(fields)}")
        if self.fields and strides != self.strides:
            raise ValueError(f"packed fields changed their tokens per row from {self.strides} to {strides} ({lengths})")
        if not self.fields:
            self.fields = {name: tensor.contiguous() for name, tensor in fields.items()}
            self.strides = strides
        else:
            self.fields = {name: cat_tokens(self.fields[name], fields[name]) for name in self.fields}
        self.tokens += tokens

    def drop_front(self, tokens: int) -> None:
        """Drop the first ``tokens`` tokens of every field (a multiple of every field's tokens per row)."""
        if tokens <= 0:
            return
        if tokens > self.tokens or any(tokens % stride for stride in self.strides.values() if stride):
            raise ValueError(f"cannot drop {tokens} of {self.tokens} tokens in rows of {self.strides} tokens")
        self.fields = {name: t[..., tokens // self.strides[name]:, :].clone() for name, t in self.fields.items()}
        self.tokens -= tokens

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every field by ``fn(field)`` (used for batch reordering)."""
        self.fields = {name: fn(tensor) for name, tensor in self.fields.items()}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.fields.values())

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())
