"""The precision of the float32 matrix products the prompt's compression runs on a CUDA GPU (the pipeline's
``products`` setting): exact float32, or TF32 tensor cores (a 10-bit mantissa on the operands, float32 sums) while a
block is stored, the model's own setting restored after. CPU products are float32 either way."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvweave.core.lazy import torch

#: ``products`` choices: exact float32, or TF32 tensor cores on a CUDA GPU
PRODUCTS = ("float32", "tf32")


def _matmul_tf32() -> tuple[str, object]:
    """Which of torch's two ways of setting float32 matmul precision to use, and its value now: the legacy
    ``allow_tf32`` flag wherever torch still reads it (a process that set nothing, or set that flag), else the
    ``fp32_precision`` string the process set (torch 2.9 and later refuse to read the flag after it; setting the
    string where the process set the flag would make its own later reads of the flag fail)."""
    matmul = torch.backends.cuda.matmul
    try:
        return "allow_tf32", matmul.allow_tf32
    except RuntimeError:  # the process set fp32_precision: keep to that API
        return "fp32_precision", matmul.fp32_precision


@contextlib.contextmanager
def float32_products(products: str) -> Iterator[None]:
    """Within the block, float32 matmuls on a CUDA GPU run as ``products`` says (:data:`PRODUCTS`); the process's
    setting is restored after, also when the block raises."""
    if products not in PRODUCTS:
        raise ValueError(f"products must be one of {', '.join(PRODUCTS)}, got {products!r}")
    if products == "float32":
        yield
        return
    api, previous = _matmul_tf32()
    setattr(torch.backends.cuda.matmul, api, "tf32" if api == "fp32_precision" else True)
    try:
        yield
    finally:
        setattr(torch.backends.cuda.matmul, api, previous)
