"""Packed storage: named tensors that grow along a token axis, and the byte count of what is held.

Every tensor the compressed cache keeps lives in a :class:`Segment` (or a plain dict of tensors for
basis state), so :func:`tensor_bytes` over them is the cache's real memory: the ``nbytes`` of each
stored tensor, metadata (scales, indices) included.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

TensorMap = dict[str, torch.Tensor]


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


class Segment:
    """Named packed tensors sharing a token axis at dim -2 (``[..., T, k]``), appended block by block."""

    def __init__(self) -> None:
        self.fields: TensorMap = {}
        self.tokens = 0

    def append(self, fields: TensorMap) -> None:
        lengths = {name: tensor.shape[-2] for name, tensor in fields.items()}
        if len(set(lengths.values())) != 1:
            raise ValueError(f"packed fields disagree on the token count: {lengths}")
        if self.fields and set(fields) != set(self.fields):
            raise ValueError(f"packed fields changed from {sorted(self.fields)} to {sorted(fields)}")
        if not self.fields:
            self.fields = {name: tensor.contiguous() for name, tensor in fields.items()}
        else:
            self.fields = {name: torch.cat((self.fields[name], fields[name]), dim=-2) for name in self.fields}
        self.tokens += next(iter(lengths.values()))

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Replace every field by ``fn(field)`` (used for batch reordering)."""
        self.fields = {name: fn(tensor) for name, tensor in self.fields.items()}

    def tensors(self) -> list[torch.Tensor]:
        return list(self.fields.values())

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())
