"""Shared helpers of the built-in quantizers: the scale dtypes they accept."""

from __future__ import annotations

import torch

SCALE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def absmax_scales(grouped: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> torch.Tensor:
    """Per-group symmetric scales: ``grouped`` [..., groups, size] -> [..., groups] with absmax / levels.

    The scale is rounded to ``scale_dtype`` first, so quantization uses exactly the scale that is stored.
    A group of zeros gets scale 1 (its codes are all zero either way).
    """
    absmax = grouped.abs().amax(dim=-1).float()
    scales = (absmax / levels).to(scale_dtype)
    return torch.where(scales == 0, torch.ones_like(scales), scales)
