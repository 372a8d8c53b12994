"""``kvweave eval`` results folders across runs: a rerun that grows or moves the needle grid, and
``kvweave eval merge`` joining runs split by length, depth or needles, at tiny sizes on the CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvweave.tools import cli, eval_folder

from test_eval import _needle_args


def test_a_rerun_may_change_the_needle_grid_and_nothing_else(tmp_path, capsys):
    grid = {"task": "needle", "seed": 0, "needle": {"lengths": [128], "depths": [0.5], "needles": 2, "protocol": "query-agnostic"}}
    run = eval_folder.RunFolder(tmp_path, grid, ["full"], "x", "cpu")
    run.add("needle|full|128|0.5|0", {"hit": True})
    grown = {**grid, "needle": {**grid["needle"], "lengths": [128, 256], "needles": 3}}
    again = eval_folder.RunFolder(tmp_path, grown, ["full"], "y", "cpu")
    assert set(again.cells) == {"needle|full|128|0.5|0"} and again.record["settings"] == grown
    assert "the grid changed (lengths [128] -> [128, 256], needles 2 -> 3)" in capsys.readouterr().err
    for other, says in (({**grown, "seed": 1}, "seed: 0 -> 1"),
                        ({**grown, "needle": {**grown["needle"], "protocol": "query-aware"}}, "protocol")):
        with pytest.raises(eval_folder.EvalError, match=says):
            eval_folder.RunFolder.check(tmp_path, other)
    assert eval_folder.off_grid(grown) == eval_folder.off_grid(grid) != eval_folder.off_grid({**grid, "seed": 1})


# --------------------------------------------------------------------------------------------- CLI


def _grid_args(folder: Path, out: Path, lengths: str, needles: str) -> list[str]:
    command = _needle_args(folder, out)
    command[command.index("--lengths") + 1] = lengths
    command[command.index("--needles") + 1] = needles
    return command


def _answers(result: dict, pipeline: str) -> list:
    return sorted((a["length"], a["depth"], a["needle"], a["answer"], a["hit"]) for a in result["pipelines"][pipeline]["answers"])


def test_merge_joins_runs_split_by_length_into_the_run_of_both(tiny_model_folder, tmp_path, capsys):
    """Two processes each ran one length; the merged folder reports what one run of both lengths reports (the
    cells are seeded per needle, length and depth), keeps both sessions, and refuses what does not belong."""
    def args(out: Path, lengths: str, needles: str = "2") -> list[str]:
        return _grid_args(tiny_model_folder, out, lengths, needles)

    for name, lengths in (("short", "128"), ("long", "192"), ("both", "128,192")):
        assert cli.main(args(tmp_path / name, lengths)) == 0
    assert cli.main(["eval", "merge", str(tmp_path / "merged"), str(tmp_path / "short"), str(tmp_path / "long")]) == 0
    merged = json.loads((tmp_path / "merged" / "needle.json").read_text())
    once = json.loads((tmp_path / "both" / "needle.json").read_text())
    for pipeline in ("full", "int4"):
        assert _answers(merged, pipeline) == _answers(once, pipeline) and len(_answers(once, pipeline)) == 8
        assert merged["pipelines"][pipeline]["grid"] == once["pipelines"][pipeline]["grid"]
    record = json.loads((tmp_path / "merged" / "settings.json").read_text())
    assert record["settings"]["needle"]["lengths"] == [128, 192] and len(record["sessions"]) == 2
    cells = [json.loads(line) for line in (tmp_path / "merged" / "cells.jsonl").read_text().splitlines()]
    assert {(c["length"], c["session"]) for c in cells} == {(128, 0), (192, 1)}  # each cell keeps the session that ran it

    capsys.readouterr()
    assert cli.main([*args(tmp_path / "seed1", "192"), "--seed", "1"]) == 0
    for bad, says in (
        ([tmp_path / "short"], "two or more"),
        ([tmp_path / "short", tmp_path / "seed1"], "seed"),  # another setting than the grid
    ):
        assert cli.main(["eval", "merge", str(tmp_path / "new"), *map(str, bad)]) == 2
        assert says in capsys.readouterr().err
    assert cli.main(["eval", "merge", str(tmp_path / "both"), str(tmp_path / "short"), str(tmp_path / "long")]) == 2
    assert "not an empty folder" in capsys.readouterr().err

    cells_file = tmp_path / "long" / "cells.jsonl"  # the same cell decoded differently in a second run
    lines = cells_file.read_text().splitlines()
    changed = json.loads(lines[0])
    changed["answer"] = changed["answer"] + " (another decode)"
    (tmp_path / "again").mkdir()
    (tmp_path / "again" / "settings.json").write_text((tmp_path / "long" / "settings.json").read_text())
    (tmp_path / "again" / "cells.jsonl").write_text(json.dumps(changed) + "\n")
    sources = [str(tmp_path / "short"), str(tmp_path / "long"), str(tmp_path / "again")]
    assert cli.main(["eval", "merge", str(tmp_path / "m2"), *sources]) == 2
    assert "--prefer" in capsys.readouterr().err
    assert cli.main(["eval", "merge", str(tmp_path / "m3"), *sources, "--prefer", "last"]) == 0
    assert changed["key"] in capsys.readouterr().err
    kept = {json.loads(line)["key"]: json.loads(line) for line in (tmp_path / "m3" / "cells.jsonl").read_text().splitlines()}
    assert kept[changed["key"]]["answer"].endswith("(another decode)") and len(kept) == 16


def test_a_grid_grown_by_resume_in_copies_split_by_length_merges_into_the_run_of_the_whole_grid(tiny_model_folder, tmp_path, capsys):
    """A 2-needle run copied twice and each copy resumed with 3 needles at one length runs only the new cells (each
    copy's new session holds one needle per depth and pipeline), says the grid changed, and the merged copies report
    what one 3-needle run of both lengths reports, with the shared first session kept once."""
    def args(out: Path, lengths: str, needles: str) -> list[str]:
        return _grid_args(tiny_model_folder, out, lengths, needles)

    assert cli.main(args(tmp_path / "whole", "128,192", "3")) == 0
    assert cli.main(args(tmp_path / "small", "128,192", "2")) == 0
    for name, length in (("grow-a", "128"), ("grow-b", "192")):
        shutil.copytree(tmp_path / "small", tmp_path / name)
        capsys.readouterr()
        assert cli.main(args(tmp_path / name, length, "3")) == 0
        assert "the grid changed (lengths [128, 192] -> [" in capsys.readouterr().err
        cells = [json.loads(line) for line in (tmp_path / name / "cells.jsonl").read_text().splitlines()]
        new = {(c["pipeline"], c["length"], c["depth"], c["needle"]) for c in cells if c["session"] == 1}
        assert new == {(p, int(length), d, 2) for p in ("full", "int4") for d in (0.0, 1.0)}
        grown = json.loads((tmp_path / name / "needle.json").read_text())
        assert grown["lengths"] == [int(length)] and grown["pipelines"]["full"]["cells"] == 6  # the report reads the grid asked
    assert cli.main(["eval", "merge", str(tmp_path / "merged"), str(tmp_path / "grow-a"), str(tmp_path / "grow-b")]) == 0
    merged = json.loads((tmp_path / "merged" / "needle.json").read_text())
    whole = json.loads((tmp_path / "whole" / "needle.json").read_text())
    for pipeline in ("full", "int4"):
        assert _answers(merged, pipeline) == _answers(whole, pipeline) and len(_answers(whole, pipeline)) == 12
    record = json.loads((tmp_path / "merged" / "settings.json").read_text())
    assert record["settings"]["needle"]["needles"] == 3 and record["settings"]["needle"]["lengths"] == [128, 192]
    assert len(record["sessions"]) == 3  # small's, then each copy's own
