"""One Triton kernel launch as data: what the lowbit decode kernels and the window kernels plan before they run."""

from __future__ import annotations

from typing import Any

import attrs


@attrs.frozen
class Launch:
    """One launch of a Triton kernel: ``kernel[grid](*args, **constants)`` fills ``outputs`` (the lowbit packed pass:
    ``m``, ``l`` [BH, splits, rows] and ``acc`` [BH, splits, rows, D], each split's running max, sum and output, rows =
    the KV head's query heads padded; the combine: the attention output [B, Hq, D]; the window kernels: the window)."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    constants: dict
    outputs: tuple

    def run(self) -> tuple:
        self.kernel[self.grid](*self.args, **self.constants)
        return self.outputs
