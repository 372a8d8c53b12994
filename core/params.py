"""Validators for component parameters (attrs fields that come from registry.toml).

Each validator raises ``ValueError``/``TypeError`` with the field's name and what is accepted; the
registry wraps that message with the pipeline and slot it came from.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterable

import attrs


def _name(attribute: attrs.Attribute) -> str:
    """The parameter's name as a registry file spells it (the field's alias, e.g. 'levels' for 'levels_')."""
    return getattr(attribute, "alias", None) or attribute.name.rstrip("_")


def _bounded(kinds: tuple[type, ...], noun: str, min_value: float | None, max_value: float | None):
    def check(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise TypeError(f"'{_name(attribute)}' must be {noun}, got {value!r} ({type(value).__name__})")
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"'{_name(attribute)}' must be a finite {noun.split()[-1]}, got {value}")
        if min_value is not None and value < min_value:
            raise ValueError(f"'{_name(attribute)}' must be >= {min_value}, got {value}")
        if max_value is not None and value > max_value:
            raise ValueError(f"'{_name(attribute)}' must be <= {max_value}, got {value}")

    return check


def integer(min_value: int | None = None, max_value: int | None = None):
    """An int (not a bool) within [min_value, max_value]."""
    return _bounded((int,), "an integer", min_value, max_value)


def number(min_value: float | None = None, max_value: float | None = None):
    """A float or int (not a bool) within [min_value, max_value]."""
    return _bounded((int, float), "a number", min_value, max_value)


def choice(options: Iterable[str]):
    """One string out of ``options``."""
    allowed = tuple(options)

    def check(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
        if value not in allowed:
            raise ValueError(f"'{_name(attribute)}' must be one of {', '.join(map(repr, allowed))}; got {value!r}")

    return check


def int_tuple(value: Any) -> tuple[int, ...]:
    """Converter: a TOML array of integers to a tuple (left unchanged when it is not a list)."""
    if isinstance(value, list):
        return tuple(value)
    return value


def shipped_path(spec: str, folder: Path, suffix: str, what: str) -> Path:
    """A component's file parameter: ``builtin:NAME`` is ``folder/NAME{suffix}``, shipped with kvweave (a ValueError
    naming the shipped ones when there is none of that name); anything else a path (``~`` expanded)."""
    if not spec.startswith("builtin:"):
        return Path(spec).expanduser()
    name = spec.removeprefix("builtin:")
    path = folder / f"{name}{suffix}"
    if not path.is_file():
        shipped = sorted(p.name.removesuffix(suffix) for p in folder.glob(f"*{suffix}"))
        raise ValueError(f"'weights' names unknown shipped {what} '{name}'; shipped: {', '.join(shipped) or '(none)'}")
    return path


def describe_fields(cls: type) -> list[dict[str, Any]]:
    """The parameter schema of a component class: name, type, default, doc (from field metadata)."""
    rows = []
    for field in attrs.fields(cls):
        if not field.init:
            continue
        default = field.default
        if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
            default = default.factory()
        if default is attrs.NOTHING:
            default = None
        type_name = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
        rows.append(
            {
                "name": field.alias,
                "type": type_name,
                "default": default,
                "required": field.default is attrs.NOTHING,
                "doc": field.metadata.get("doc", ""),
            }
        )
    return rows
