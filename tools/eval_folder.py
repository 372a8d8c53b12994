"""The results folder of ``kvweave eval``: ``settings.json`` + ``cells.jsonl``, resumable.

``settings.json`` holds the settings, the pipelines, and per session the command, date, git commit,
package versions and device; ``cells.jsonl`` one line per finished cell (written, flushed and synced as it
finishes), keyed ``task|pipeline|cell...``. Rerunning the same command resumes: finished cells are read
back, the rest are run. A folder written with other settings is refused (``--fresh`` discards it); adding
pipelines is allowed, since every cell is keyed by its pipeline, and so is another grid (:data:`GRID_AXES`: a
needle run with more needles, other lengths or depths keeps the cells it already ran and runs only the new ones,
each cell being seeded by its own point of the grid; the report reads the cells of the grid asked).

A crash can only lose the cell in progress: a line is appended whole, flushed and synced before the cell
counts as done, and a last line cut short (a killed process, a full disk) is cut off when the folder is
opened to resume (with a one-line notice), so the next cell starts on a line of its own.

The settings are checked before the folder is touched (:func:`kvweave.tools.eval_checks.check_settings`, and
:func:`~kvweave.tools.eval_checks.check_model_context` once the model is loaded), so a mistyped option never leaves a folder that
refuses the corrected command. Also the small helpers the tasks share to turn cells into results
(:func:`single_cells`, :func:`mean`, :func:`slug`). Nothing here runs a model.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvweave.core.errors import KvweaveError


class EvalError(KvweaveError):
    """A bad evaluation setting or run folder."""


TASKS = ("needle", "qa", "ppl", "fidelity", "speed")
#: what each task's entry of the settings holds (what ``kvweave eval report`` reads back)
TASK_SETTINGS: dict[str, tuple[str, ...]] = {
    "needle": ("lengths", "depths", "needles"),
    "qa": ("datasets", "qa_samples", "qa_length"),
    "ppl": ("tokens", "chunk"),
    "fidelity": ("tokens", "chunk", "probe"),
    "speed": ("speed_tokens", "speed_new_tokens"),
}
MIN_TOKENS = 16  # the shortest context a task measures (Evaluation.check_length's floor)
ESSAYS_FILE = "PaulGrahamEssays.json"
#: the axes of a task's grid that a rerun into the same folder (and ``kvweave eval merge``) may change: a cell is keyed
#: and seeded by its own point of the grid (a needle by its index in the seed's sequence, which a larger count extends)
GRID_AXES: dict[str, tuple[str, ...]] = {"needle": ("lengths", "depths", "needles")}


def off_grid(settings: dict[str, Any]) -> dict[str, Any]:
    """``settings`` without the axes of its task's grid (what must agree for two runs' cells to be one grid's)."""
    rest = copy.deepcopy(settings)
    task = settings.get("task")
    entry = rest.get(task) if isinstance(task, str) else None
    if isinstance(entry, dict):
        for axis in GRID_AXES.get(task, ()):
            entry.pop(axis, None)
    return rest


def _notice(message: str) -> None:
    print(f"kvweave: {message}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------- settings checks
def environment(device: str) -> dict[str, Any]:
    """Versions, git commit and device of this process (recorded per session in settings.json)."""
    import torch
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("kvweave", "triton", "numpy"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - an absent optional package is simply not listed
            pass
    commit, dirty = _git_state(Path(__file__).resolve().parents[1])
    if device.startswith("cuda") and torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(torch.device(device))
    else:
        hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    return {"versions": versions, "git_commit": commit or None, "git_dirty": dirty, "device": device, "hardware": hardware,
            "platform": platform.platform()}


def _git_state(source: Path) -> tuple[str, bool]:
    """The commit and dirtiness of the git checkout kvweave runs from; ("", False) when it does not run
    from its own checkout (an installed wheel, or a copy inside another repository)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != source:
            return "", False
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "", False


class RunFolder:
    """``settings.json`` + ``cells.jsonl`` of one evaluation run, resumable."""

    def __init__(self, path: Path, settings: dict[str, Any], pipelines: list[str], command: str, device: str, fresh: bool = False) -> None:
        self.path = Path(path)
        self.settings_file = self.path / "settings.json"
        self.cells_file = self.path / "cells.jsonl"
        old = self.check(self.path, settings, fresh)
        self.path.mkdir(parents=True, exist_ok=True)
        record: dict[str, Any] = {"settings": settings, "pipelines": [], "sessions": []}
        if old is not None:
            record = old
            if old["settings"] != settings:
                task = settings.get("task")
                changes = ", ".join(f"{axis} {old['settings'][task].get(axis)} -> {settings[task].get(axis)}"
                                    for axis in GRID_AXES[task] if old["settings"][task].get(axis) != settings[task].get(axis))
                _notice(f"{self.path}: the grid changed ({changes}); the cells already run are kept, the rest are run")
            record["settings"] = settings
        elif fresh and self.cells_file.exists():
            self.cells_file.unlink()
        record["pipelines"] = list(dict.fromkeys([*record.get("pipelines", []), *pipelines]))
        when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record.setdefault("sessions", []).append({"started": when, "command": command, **environment(device)})
        self.session = len(record["sessions"]) - 1
        self._write_settings(record)
        self.settings = settings
        self.record = record
        self.cells = self._read(repair=True)

    @staticmethod
    def check(path: Path, settings: dict[str, Any], fresh: bool = False) -> dict[str, Any] | None:
        """Whether a run with ``settings`` may use folder ``path``, touching nothing: the folder's record
        when it holds a run with the same settings, or the same apart from the grid (to resume), None when it
        holds none (or ``fresh``); an :class:`EvalError` when it holds a run with other settings, or an
        unreadable one."""
        path = Path(path)
        settings_file = path / "settings.json"
        if path.exists() and not path.is_dir():
            raise EvalError(f"--out {path} is a file, not a folder; choose another --out")
        if fresh or not settings_file.exists():
            return None
        old = _read_record(settings_file, "use --fresh to start this folder anew")
        if old["settings"] != settings and off_grid(old["settings"]) != off_grid(settings):
            keys = sorted(set(old["settings"]) | set(settings))
            changed = [f"{k}: {old['settings'].get(k)!r} -> {settings.get(k)!r}" for k in keys
                       if old["settings"].get(k) != settings.get(k)]
            raise EvalError(
                f"{path} holds a run with other settings ({'; '.join(changed)}); run the same command to resume it, "
                "choose another --out, or pass --fresh to discard it"
            )
        return old

    @classmethod
    def existing(cls, path: Path) -> RunFolder:
        """An existing run folder, read only (for ``kvweave eval report``)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.settings_file = self.path / "settings.json"
        self.cells_file = self.path / "cells.jsonl"
        if not self.settings_file.is_file():
            raise EvalError(f"{self.path} is not a kvweave eval results folder (no settings.json)")
        self.record = _read_record(self.settings_file, "it is written by kvweave eval; rerun the evaluation with --fresh to rewrite it",
                                   report=True)
        self.settings = self.record["settings"]
        self.session = len(self.record["sessions"]) - 1
        self.cells = self._read(repair=False)
        return self

    def _write_settings(self, record: dict[str, Any]) -> None:
        temp = self.settings_file.with_suffix(".json.partial")
        with temp.open("w", encoding="utf-8") as file:
            file.write(json.dumps(record, indent=1) + "\n")
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, self.settings_file)

    def _read(self, repair: bool) -> dict[str, dict[str, Any]]:
        """The finished cells. A line that is not JSON is an interrupted write (a last line cut short by a
        crash, or, in folders of older versions, one that the next cell was appended to): with ``repair``
        it is removed from the file (the last line by truncating the file, others by rewriting it) and its
        cell runs again, else it is skipped; either way with a one-line notice. A JSON line that is not a
        cell (an object with a string "key") is an error naming the file and the line."""
        cells: dict[str, dict[str, Any]] = {}
        if not self.cells_file.exists():
            return cells
        data = self.cells_file.read_bytes()
        segments = data.split(b"\n")
        if segments[-1] == b"":
            segments.pop()  # the file ends with a newline
        good: list[bytes] = []
        bad: list[tuple[int, int, bytes]] = []  # (line number, byte offset, text)
        offset = 0
        for number, raw in enumerate(segments, start=1):
            if raw.strip():
                try:
                    item = json.loads(raw.decode("utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    bad.append((number, offset, raw))
                else:
                    cells[self._cell_key(item, number)] = item
                    good.append(raw)
            offset += len(raw) + 1
        unterminated = bool(data) and not data.endswith(b"\n")
        if not bad and not unterminated:
            return cells
        if bad:
            numbers = [number for number, _, _ in bad]
            last = bad[-1][2].decode("utf-8", errors="replace").strip()
            shown = last if len(last) <= 48 else last[:45] + "..."
            what = (f"its last line, cut short by an interrupted write ({shown!r})" if numbers == [len(segments)]
                    else f"{len(bad)} line(s) cut short by interrupted writes (line {', '.join(map(str, numbers))})")
        if not repair:
            if bad:
                _notice(f"{self.cells_file}: skipped {what}")
            return cells
        if not bad or numbers == [len(segments)]:  # only the end is torn: cut it off (or end the last line)
            with self.cells_file.open("r+b") as file:
                if bad:
                    file.truncate(bad[0][1])
                else:
                    file.seek(0, os.SEEK_END)
                    file.write(b"\n")
                file.flush()
                os.fsync(file.fileno())
        else:
            temp = self.cells_file.with_suffix(".jsonl.partial")
            with temp.open("wb") as file:
                file.write(b"".join(line + b"\n" for line in good))
                file.flush()
                os.fsync(file.fileno())
            os.replace(temp, self.cells_file)
        if bad:
            _notice(f"{self.cells_file}: removed {what}; {'that cell runs' if len(bad) == 1 else 'those cells run'} again")
        return cells

    def _cell_key(self, item: Any, number: int) -> str:
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            got = f"an object with keys {sorted(item)[:6]}" if isinstance(item, dict) else f"a JSON {type(item).__name__}"
            raise EvalError(
                f"{self.cells_file}, line {number}: a cell record must be a JSON object with a string \"key\" "
                f"(task|pipeline|cell), got {got}; this is not a cells file kvweave eval wrote. Delete that line "
                "or pass --fresh to start the folder anew"
            )
        return item["key"]

    def get(self, key: str) -> dict[str, Any] | None:
        return self.cells.get(key)

    def add(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        """Append one finished cell: a whole line, flushed and synced. A write that fails (a full disk) is
        undone, so the file never holds half a line, and reported as an :class:`EvalError`."""
        item = {"key": key, "session": self.session, **record}
        line = (json.dumps(item) + "\n").encode("utf-8")
        with self.cells_file.open("ab") as file:
            start = file.tell()
            try:
                file.write(line)
                file.flush()
                os.fsync(file.fileno())
            except OSError as exc:
                try:
                    file.truncate(start)
                except OSError:
                    pass  # the next open cuts the torn line off
                raise EvalError(f"writing a finished cell to {self.cells_file} failed: {exc}; the cells before it are saved, "
                                "run the same command again to resume") from exc
        self.cells[key] = item
        return item

    def records(self, task: str, name: str) -> list[dict[str, Any]]:
        """Every finished cell of ``task`` for pipeline ``name``."""
        prefix = key(task, name) + "|"
        return [item for k, item in self.cells.items() if k.startswith(prefix)]

    def write_json(self, name: str, data: Any) -> Path:
        path = self.path / name
        path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        return path


def _read_record(settings_file: Path, fix: str, report: bool = False) -> dict[str, Any]:
    """The record of ``settings.json``, checked for what kvweave reads from it (with ``report``, also what
    ``kvweave eval report`` reads: the task, the model, each task's settings); an :class:`EvalError`
    naming the file and what is wrong otherwise (``fix`` says what to do)."""
    try:
        record = json.loads(settings_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EvalError(f"{settings_file} is not valid JSON ({exc}); {fix}") from exc
    except OSError as exc:
        raise EvalError(f"{settings_file} cannot be read: {exc}") from exc

    def wrong(what: str) -> EvalError:
        return EvalError(f"{settings_file} is not a kvweave eval settings file: {what}; {fix}")

    if not isinstance(record, dict):
        raise wrong(f"it holds a JSON {type(record).__name__}, expected an object with \"settings\", \"pipelines\" and \"sessions\"")
    missing = [k for k in ("settings", "pipelines", "sessions") if k not in record]
    if missing:
        raise wrong(f"it lacks {', '.join(repr(k) for k in missing)}")
    settings = record["settings"]
    if not isinstance(settings, dict):
        raise wrong(f"\"settings\" is a JSON {type(settings).__name__}, expected an object")
    if not isinstance(record["pipelines"], list) or not all(isinstance(n, str) for n in record["pipelines"]):
        raise wrong("\"pipelines\" must be a list of pipeline names")
    if not isinstance(record["sessions"], list) or not record["sessions"]:
        raise wrong("\"sessions\" must be a non-empty list")
    if not report:
        return record
    for name in ("task", "model"):
        if not isinstance(settings.get(name), str):
            raise wrong(f"\"settings\" lacks the string {name!r}")
    for task, names in TASK_SETTINGS.items():
        if task not in settings or settings[task] is None:
            continue
        opts = settings[task]
        if not isinstance(opts, dict):
            raise wrong(f"\"settings\".{task} is a JSON {type(opts).__name__}, expected an object")
        absent = [n for n in names if n not in opts]
        if absent:
            raise wrong(f"\"settings\".{task} lacks {', '.join(repr(n) for n in absent)}")
    return record


def key(*parts: Any) -> str:
    return "|".join(str(p) for p in parts)


def single_cells(run: RunFolder, task: str, pipelines: list[str], errors: dict[str, str], *cell: Any) -> dict[str, Any]:
    """Per pipeline, the record of ``task``'s one cell ``cell`` (tasks with one cell per pipeline), or
    ``{"error": ...}`` (the pipeline's error, else "not run")."""
    out = {}
    for name in pipelines:
        record = run.get(key(task, name, *cell))
        out[name] = {"error": errors.get(name, "not run")} if record is None or name in errors else strip(record)
    return out


def strip(record: dict[str, Any]) -> dict[str, Any]:
    """A cell's record without its bookkeeping (``key``, ``task``, ``pipeline``)."""
    return {k: v for k, v in record.items() if k not in ("key", "task", "pipeline")}


def mean(values: Iterable[float]) -> float:
    """The mean of ``values``; NaN when there are none."""
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def slug(name: str) -> str:
    """``name`` made safe for a file name."""
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)
