"""Settings read from the environment once, at import: on/off switches and integer settings that let a benchmark time
two ways of doing the same work in one run (``KVWEAVE_*`` variables). A value outside the allowed ones is refused
naming the variable and what it takes."""

from __future__ import annotations

import os


def env_switch(name: str) -> bool:
    """The environment's on/off switch ``name`` (unset: on); a value that is neither is refused by name."""
    value = os.environ.get(name, "1").strip().lower()
    if value in ("1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"environment variable {name}={os.environ[name]!r}: expected 1/on/true/yes or 0/off/false/no")


def env_setting(name: str, default: int, allowed: tuple[int, ...]) -> int:
    """The environment's setting ``name`` (unset: ``default``), one of ``allowed``; another value is refused by name."""
    value = os.environ.get(name, str(default)).strip()
    if value.isdigit() and int(value) in allowed:
        return int(value)
    raise ValueError(f"environment variable {name}={value!r}: expected one of {', '.join(map(str, allowed))}")
