"""``kvweave eval merge OUT FOLDER...``: one needle results folder from runs of the same evaluation split by
context length, depth or needles (several processes on one device, or several machines).

The folders must hold the same settings apart from the grid (lengths, depths, needle count; model, dtype,
protocol, registry, ... agree); their pipelines, lengths and depths are joined and the needle count is the
largest, their sessions kept in order (each cell keeps the session that ran it; a session two folders share,
as copies of one folder resumed with other grids do, is kept once), and a cell found in two folders must hold the same answer, unless ``--prefer first`` or
``--prefer last`` says which folder's cell to keep (a cell run twice on a GPU can decode differently once the needle
is lost; each such cell is reported). ``OUT`` must be new or empty. ``kvweave eval report OUT`` then builds its
needle.json and plots (``merge`` runs it).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from kvweave.tools.eval_folder import GRID_AXES, EvalError, RunFolder, off_grid

#: the settings of a needle run that may differ between the folders merged (lengths and depths joined, the
#: largest needle count kept)
GRID = GRID_AXES["needle"]
#: what a cell found in two folders may differ in
VOLATILE = ("session", "seconds")


def merged_record(sources: list[Path], prefer: str | None = None) -> tuple[dict[str, Any], list[dict[str, Any]], list[str]]:
    """The settings record, the cells of ``sources`` joined, and the keys of the cells that differed between two
    folders (kept from the ``prefer`` one: "first" or "last"; None: such a cell is an error)."""
    if prefer not in (None, "first", "last"):
        raise EvalError(f"--prefer takes 'first' or 'last', got {prefer!r}")
    if len(sources) < 2:
        raise EvalError(f"kvweave eval merge joins two or more results folders, got {len(sources)}")
    runs = [RunFolder.existing(path) for path in sources]
    first = runs[0]
    if first.settings.get("task") != "needle":
        raise EvalError(f"{first.path}: a '{first.settings.get('task')}' run; kvweave eval merge joins needle runs split by length, depth or needles")
    base = off_grid(first.settings)
    record: dict[str, Any] = {"settings": copy.deepcopy(first.settings), "pipelines": [], "sessions": []}
    cells: dict[str, dict[str, Any]] = {}
    origin: dict[str, Path] = {}
    differed: list[str] = []
    for run in runs:
        other = off_grid(run.settings)
        if other != base:
            keys = sorted(set(base) | set(other))
            changed = [f"{k}: {base.get(k)!r} in {first.path} -> {other.get(k)!r}" for k in keys if base.get(k) != other.get(k)]
            raise EvalError(f"{run.path} was run with other settings than {first.path} ({'; '.join(changed)}); only "
                            f"{', '.join(GRID)} may differ")
        number: list[int] = []  # this folder's session i is the record's session number[i]
        for session in run.record["sessions"]:
            if session not in record["sessions"]:
                record["sessions"].append(session)
            number.append(record["sessions"].index(session))
        record["pipelines"] = list(dict.fromkeys([*record["pipelines"], *run.record["pipelines"]]))
        grid, theirs = record["settings"]["needle"], run.settings["needle"]
        grid["lengths"] = sorted(set(grid["lengths"]) | set(theirs["lengths"]))
        grid["depths"] = sorted(set(grid["depths"]) | set(theirs["depths"]))
        grid["needles"] = max(grid["needles"], theirs["needles"])
        for key, cell in run.cells.items():
            moved = {**cell, "session": number[int(cell.get("session", 0))]}
            if key in cells:
                same = {k: v for k, v in cells[key].items() if k not in VOLATILE} == {k: v for k, v in moved.items() if k not in VOLATILE}
                if not same:
                    if prefer is None:
                        raise EvalError(f"cell {key!r} is in {origin[key]} and in {run.path} with different results; pass "
                                        "--prefer first or --prefer last to keep one folder's cells")
                    differed.append(key)
                if same or prefer == "first":
                    continue
            cells[key], origin[key] = moved, run.path
    return record, list(cells.values()), differed


def merge(out: Path, sources: list[Path], prefer: str | None = None) -> tuple[Path, list[str]]:
    """Write the joined folder ``out`` (new or empty) from ``sources``; returns ``out`` and the keys of the cells that
    differed between folders (see :func:`merged_record`)."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise EvalError(f"{out} exists and is not an empty folder; kvweave eval merge writes a new folder")
    if any(Path(source).resolve() == out.resolve() for source in sources):
        raise EvalError(f"{out} is one of the folders to merge; choose a new folder")
    record, cells, differed = merged_record([Path(source) for source in sources], prefer)
    out.mkdir(parents=True, exist_ok=True)
    (out / "settings.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    (out / "cells.jsonl").write_text("".join(json.dumps(cell) + "\n" for cell in cells), encoding="utf-8")
    return out, differed
