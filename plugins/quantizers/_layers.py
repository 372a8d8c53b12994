"""Per-layer width tables (``layer_bits``) shared by the quantizers that take one.

A table gives one width per layer of the model, so layers that lose more to quantization can take more
bits than those that lose little at the same average (layer-wise mixed precision, as in KVTuner: Li et al.,
"KVTuner: Sensitivity-Aware Layer-wise Mixed Precision KV Cache Quantization", arXiv:2502.04420).
``benchmarks/layer_sensitivity.py`` measures a model's layers and prints a table for a given average.
"""

from __future__ import annotations

from typing import Any, Callable

import attrs

from kvweave.core.errors import ModelError


def layer_table(value: Any) -> tuple:
    """A TOML list (or tuple) of numbers -> a tuple; anything else is refused with its type."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(value)
    raise TypeError(f"'layer_bits' must be a list of numbers, one per layer of the model, got {value!r}")


def name_table(value: Any) -> tuple:
    """A TOML list (or tuple) of strings -> a tuple (a per-layer table of named choices, e.g. ``layer_levels``);
    anything else is refused with its type."""
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise TypeError(f"a per-layer table of names must be a list of strings, one per layer of the model, got {value!r}")


def each_entry(check: Callable[[Any, Any, Any], None], name: str) -> Callable[[Any, Any, tuple], None]:
    """A validator applying ``check`` (the validator of the width ``name``) to every entry of a table."""

    def validate(instance: Any, attribute: attrs.Attribute, value: tuple) -> None:
        target = attrs.fields_dict(type(instance))[name]
        for layer, entry in enumerate(value):
            try:
                check(instance, target, entry)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"'{attribute.name}' entry {layer} (layer {layer}): {exc}") from exc

    return validate


def check_table(table: tuple, num_layers: int, component: str, name: str = "layer_bits") -> None:
    """Refuse a table (``name``) whose length is not the model's number of layers."""
    if table and len(table) != num_layers:
        raise ModelError(
            f"{component}: {name} has {len(table)} entries but the model has {num_layers} layers; give one "
            f"entry per layer (benchmarks/layer_sensitivity.py prints a width table for a model)"
        )
