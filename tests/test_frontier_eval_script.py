"""benchmarks/frontier_eval.sh with SPLIT=cells (one process per pipeline, length and depth, joined per pipeline)
and with PIPELINES `all`, on a tiny model on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _script_env(**values: str) -> dict:
    """The environment of a frontier_eval.sh run with ``values`` set: the script calls the `kvweave` command, and the
    one installed beside this interpreter comes first."""
    path = os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")])
    return {**os.environ, "PATH": path, **values}


def _frontier_cells(model, out, pipelines: str, **grid: str) -> subprocess.CompletedProcess:
    """benchmarks/frontier_eval.sh with SPLIT=cells on the CPU, one needle at length 64 (``grid``: DEPTHS, JOBS)."""
    env = _script_env(DEVICE="cpu", DTYPE="float32", NEEDLES="1", LENGTHS="64", TOKENS="96", SPLIT="cells", **grid)
    return subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_eval.sh"), str(model), str(out), pipelines],
                          capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


def test_frontier_eval_split_by_cells_joins_each_pipelines_grid(tmp_path, tiny_model_folder):
    """benchmarks/frontier_eval.sh with SPLIT=cells: one process per (pipeline, length, depth), each pipeline's
    parts merged into OUT/PIPELINE with every cell of the grid, perplexity run beside, and the table built from
    both (tiny model, CPU)."""
    out = tmp_path / "frontier"
    done = _frontier_cells(tiny_model_folder, out, "full,int4", DEPTHS="0.1,0.9", JOBS="2")
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("full", "int4"):
        cells = [json.loads(line) for line in (out / name / "cells.jsonl").read_text().splitlines()]
        assert sorted((c["pipeline"], c["length"], c["depth"]) for c in cells) == [(name, 64, d) for d in (0.1, 0.9)]
    rows = {line.split("|")[1].strip(): line for line in (out / "frontier.md").read_text().splitlines() if line.startswith("| `")}
    assert set(rows) == {"`full`", "`int4`"}
    assert not rows["`int4`"].rstrip().endswith("| - |")  # its perplexity, from the ppl folder
    # a rerun into the same folder (e.g. after the machine was taken away) keeps what completed and joins again
    before = {path: path.read_text() for path in sorted(out.glob("cells/*/cells.jsonl"))}
    again = _frontier_cells(tiny_model_folder, out, "full,int4", DEPTHS="0.1,0.9", JOBS="2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert len(before) == 4 and {path: path.read_text() for path in before} == before  # no cell evaluated twice
    assert (out / "int4" / "cells.jsonl").read_text().count("\n") == 2


def test_frontier_eval_split_by_cells_takes_a_grid_of_one_cell(tmp_path, tiny_model_folder):
    """SPLIT=cells with one length and one depth: the pipeline's folder is its one cell (``kvweave eval merge`` joins
    two or more folders and refused it, stopping the script before the table)."""
    out = tmp_path / "frontier"
    done = _frontier_cells(tiny_model_folder, out, "full", DEPTHS="0.5", JOBS="1")
    assert done.returncode == 0, done.stderr[-3000:]
    cells = [json.loads(line) for line in (out / "full" / "cells.jsonl").read_text().splitlines()]
    assert [(c["pipeline"], c["length"], c["depth"]) for c in cells] == [("full", 64, 0.5)]
    assert "| `full`" in (out / "frontier.md").read_text()


def test_frontier_eval_all_names_every_registry_pipeline_and_stops_at_a_failed_process(tmp_path):
    """PIPELINES `all`: the pipelines `kvweave pipelines` lists, this registry's on top; a needle process that fails
    (here: no such model) stops the script with a message instead of a table built from what is missing."""
    from kvweave.core.registry import load_registry

    extra = tmp_path / "extra.toml"
    extra.write_text('[pipelines.my-int4]\nextends = "int4"\n')
    env = _script_env(DEVICE="cpu", JOBS="1", SPLIT="cells")
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_eval.sh"), str(tmp_path / "no-model"), str(tmp_path / "out"),
                           "all", str(extra)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    listed = next(line for line in done.stderr.splitlines() if " pipelines: " in line).split(" pipelines: ")[1].split(",")
    assert listed == list(load_registry(str(extra)).tables) and "my-int4" in listed and len(listed) > 40
    assert done.returncode == 1 and "a needle process failed" in done.stderr
    assert not (tmp_path / "out" / "frontier.md").exists()
