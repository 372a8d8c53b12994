"""Small input/output helpers shared by the ``kvweave`` commands."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvweave.core.errors import KvweaveError


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of the file ``what`` names (an option, e.g. ``--prompt-file``), or a
    :class:`KvweaveError` saying whether it is missing, a folder, unreadable or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise KvweaveError(f"{what} {path} is a folder, not a file; pass the path of a file inside it")
    if not path.exists():
        raise KvweaveError(f"{what} {path} does not exist (resolved to {path.absolute()})")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvweaveError(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise KvweaveError(
            f"{what} {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line}) "
            "cannot be decoded; save the file as UTF-8"
        ) from exc
