"""Triton's grid dependency control (programmatic dependent launch: Hopper GPUs, Triton 3.4 and later), imported once
for the kernels that take it (:func:`kvweave.kernels.launch.programmatic` says where): ``gdc_wait`` and
``gdc_launch_dependents``, or None for both where this Triton lacks them (no launch then asks for them)."""

from __future__ import annotations

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - no Triton, or one before 3.4: kernels are launched one after the other
    gdc_launch_dependents = gdc_wait = None
