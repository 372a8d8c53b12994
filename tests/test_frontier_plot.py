"""benchmarks/frontier_plot.py (the frontier's table and plot from needle and perplexity runs, merged over the folders
of a grid run in parts) and benchmarks/frontier_eval.sh's refusals."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _needle(folder: Path, pipelines: dict, needles: int = 1) -> None:
    folder.mkdir(parents=True)
    grid = {"lengths": [100], "depths": [0.5], "needles": [{"answer": str(n)} for n in range(needles)], "protocol": "query-agnostic"}
    (folder / "needle.json").write_text(json.dumps({**grid, "pipelines": pipelines}))


def _answers(hits: list[bool], stored: int) -> dict:
    return {"answers": [{"length": 100, "depth": 0.5, "needle": n, "hit": h, "full_16bit_bytes": 1000, "stored_bytes": stored}
                        for n, h in enumerate(hits)]}


def test_frontier_plot_merges_runs_taking_each_pipeline_from_the_first_folder(tmp_path, monkeypatch):
    """benchmarks/frontier_plot.py over a grid run in parts: 'of full' counts the cases the full cache of
    another part answered; a pipeline in two folders comes from the first; a different grid is refused."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    _needle(tmp_path / "a", {"full": _answers([True, True, False], 1000), "x": _answers([True, False, False], 250)}, needles=3)
    _needle(tmp_path / "b", {"x": _answers([False, False, False], 500), "y": _answers([True, True, True], 200)}, needles=3)
    needle, _ = frontier_plot.merged([tmp_path / "a", tmp_path / "b"])
    rows = {row["pipeline"]: row["lengths"][100] for row in frontier_plot.rows(needle, None)}
    assert rows["x"]["of_full"] == 1 and rows["x"]["full_found"] == 2 and rows["x"]["ratio"] == 4.0  # from folder a
    assert rows["y"]["of_full"] == 2 and rows["y"]["hits"] == 3 and rows["y"]["ratio"] == 5.0
    _needle(tmp_path / "c", {"z": _answers([True], 100)}, needles=1)
    with pytest.raises(SystemExit, match="grid"):
        frontier_plot.merged([tmp_path / "a", tmp_path / "c"])


def test_frontier_plot_lists_misses_and_wilson_intervals(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    _needle(tmp_path / "a", {"full": _answers([True, True, False], 1000), "x": _answers([True, False, True], 250)}, needles=3)
    needle, _ = frontier_plot.merged([tmp_path / "a"])
    table = frontier_plot.rows(needle, None)
    assert {row["pipeline"]: row["lengths"][100]["missed"] for row in table} == {"full": [], "x": [(100, 0.5, 1)]}
    assert frontier_plot.misses(table, [100]) == "- `x`: (100, 0.5, 1)"  # needle 2 is beyond full: not a miss
    text = frontier_plot.markdown(table, [100], intervals=True)
    low, high = frontier_plot.wilson(1, 2)
    assert f"1/2 (50.0%) [{low:.0%}-{high:.0%}]" in text and "of full [95% interval]" in text
    assert "[" not in frontier_plot.markdown(table, [100]).splitlines()[2]
    # the Wilson interval: inside [0, 1], around the share, narrower with more cases, (0, 1) without any
    for found, cases in ((0, 5), (5, 5), (39, 41), (27, 28)):
        low, high = frontier_plot.wilson(found, cases)
        assert 0.0 <= low <= found / cases <= high <= 1.0
    assert frontier_plot.wilson(0, 0) == (0.0, 1.0)
    assert frontier_plot.wilson(39, 41)[1] - frontier_plot.wilson(39, 41)[0] > frontier_plot.wilson(390, 410)[1] - frontier_plot.wilson(390, 410)[0]
    low, high = frontier_plot.wilson(39, 41)
    assert abs(low - 0.839) < 0.005 and abs(high - 0.986) < 0.005  # the textbook 95% Wilson bounds of 39 / 41


def test_frontier_plot_common_counts_only_the_cells_every_pipeline_ran(tmp_path, monkeypatch):
    """A run cut short (needles 0-1 of 4) against fuller ones: --common counts the full cache, hits, bytes and
    misses on the shared cells only; without it each pipeline keeps all its cells."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    _needle(tmp_path / "a", {"full": _answers([True, True, True, True], 1000), "x": _answers([True, False, False, False], 250),
                             "short": _answers([False, True], 100)}, needles=4)
    needle, _ = frontier_plot.merged([tmp_path / "a"])
    every = {row["pipeline"]: row["lengths"][100] for row in frontier_plot.rows(needle, None)}
    assert every["x"]["of_full"] == 1 and every["x"]["full_found"] == 4 and every["short"]["full_found"] == 2
    shared = {row["pipeline"]: row["lengths"][100] for row in frontier_plot.rows(needle, None, common=True)}
    assert shared["full"]["cases"] == shared["x"]["cases"] == shared["short"]["cases"] == 2
    assert shared["x"]["of_full"] == 1 and shared["x"]["full_found"] == 2 and shared["x"]["missed"] == [(100, 0.5, 1)]
    assert shared["short"]["missed"] == [(100, 0.5, 0)]
    _needle(tmp_path / "b", {"full": _answers([True], 1000), "y": {"answers": [{**_answers([True, True], 500)["answers"][1]}]}})
    with pytest.raises(SystemExit, match="share no cell"):
        frontier_plot.rows(frontier_plot.merged([tmp_path / "b"])[0], None, common=True)


def test_frontier_plot_draws_a_perplexity_panel_where_perplexities_were_measured(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    _needle(tmp_path / "a", {"full": _answers([True, True], 1000), "x": _answers([True, False], 25)}, needles=2)
    needle, _ = frontier_plot.merged([tmp_path / "a"])
    table = frontier_plot.rows(needle, None)
    ppl = {"tokens": 800, "prefill": 400, "dynamic_cache_ppl": 10.0,
           "pipelines": {"x": {"ppl": 10.5, "stored_bytes": 30, "full_16bit_bytes": 1200}}}
    assert frontier_plot.plot(table, [100], tmp_path / "n.png", "t") == ["100 tokens"]
    assert frontier_plot.plot(table, [100], tmp_path / "p.png", "t", ppl) == ["100 tokens", "perplexity of 400 tokens after 400"]
    stopped = {**ppl, "pipelines": {"x": {"error": "not run"}}}  # a perplexity run stopped before it: no panel, no crash
    assert frontier_plot.plot(table, [100], tmp_path / "u.png", "t", stopped) == ["100 tokens"]
    assert (tmp_path / "p.png").stat().st_size > 0
    many = [{"pipeline": f"p{i}", "lengths": {100: {"ratio": 1.0 + i, "of_full": 1, "full_found": 2}}} for i in range(60)]
    assert frontier_plot.plot(many, [100], tmp_path / "many.png", "t") == ["100 tokens"]  # 60 pipelines, ratios to 60x


def test_frontier_plot_merges_perplexities_of_one_protocol_only(tmp_path, monkeypatch, capsys):
    """ppl.json files merge when measured alike (tokens, chunk, prefill, reference); a run without a prefill
    is left out (with a note) next to one with it, and the column says what was scored."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    def ppl(folder: Path, prefill: int, pipelines: dict) -> None:
        record = {"tokens": 800, "chunk": 64, "dynamic_cache_ppl": 10.0, "pipelines": pipelines}
        (folder / "ppl.json").write_text(json.dumps({**record, **({"prefill": prefill} if prefill is not None else {})}))

    for name, prefill, value in (("a", 400, 10.5), ("b", 400, 11.0), ("c", None, 12.0)):
        _needle(tmp_path / name, {"full": _answers([True], 1000), name: _answers([True], 200)})
        ppl(tmp_path / name, prefill, {name: {"ppl": value}})
    needle, merged_ppl = frontier_plot.merged([tmp_path / "a", tmp_path / "b"])
    rows = {row["pipeline"]: row for row in frontier_plot.rows(needle, merged_ppl)}
    assert rows["a"]["ppl"] == 10.5 and abs(rows["b"]["ppl_change"] - 0.1) < 1e-9
    assert "ppl of 400 tok after a 400-tok prefill" in frontier_plot.markdown(list(rows.values()), [100], 800, 400)
    needle, merged_ppl = frontier_plot.merged([tmp_path / "a", tmp_path / "c"])  # c's perplexity is left out, said so
    assert "c" not in merged_ppl["pipelines"] and "c" in needle["pipelines"]
    assert "do not compare" in capsys.readouterr().err
    # another device: same protocol, its own full cache (12.0): d's change is against 12.0, a's still against 10.0
    _needle(tmp_path / "d", {"full": _answers([True], 1000), "d": _answers([True], 200)})
    (tmp_path / "d" / "ppl.json").write_text(json.dumps({"tokens": 800, "chunk": 64, "prefill": 400, "dynamic_cache_ppl": 12.0,
                                                        "pipelines": {"d": {"ppl": 12.6, "stored_bytes": 50, "full_16bit_bytes": 1000}}}))
    needle, merged_ppl = frontier_plot.merged([tmp_path / "a", tmp_path / "d"])
    rows = {row["pipeline"]: row for row in frontier_plot.rows(needle, merged_ppl)}
    assert abs(rows["d"]["ppl_change"] - 0.05) < 1e-9 and abs(rows["a"]["ppl_change"] - 0.05) < 1e-9
    assert "its own full cache" in capsys.readouterr().err
    merged_ppl["pipelines"]["a"].update(stored_bytes=40, full_16bit_bytes=1000)
    assert frontier_plot.plot(list(rows.values()), [100], tmp_path / "two.png", "t", merged_ppl)[-1].startswith("perplexity")


def test_frontier_plot_takes_a_perplexity_run_from_a_folder_of_its_own(tmp_path, monkeypatch):
    """A folder with only ppl.json (a separate `kvweave eval ppl` run) adds its perplexities; a folder with
    neither file is refused by name."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import frontier_plot

    _needle(tmp_path / "a", {"full": _answers([True, True], 1000), "x": _answers([True, False], 250)}, needles=2)
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "ppl.json").write_text(json.dumps(
        {"tokens": 80, "chunk": 8, "prefill": 40, "dynamic_cache_ppl": 10.0, "pipelines": {"x": {"ppl": 10.5}}}))
    needle, ppl = frontier_plot.merged([tmp_path / "a", tmp_path / "p"])
    row = {r["pipeline"]: r for r in frontier_plot.rows(needle, ppl)}["x"]
    assert row["ppl"] == 10.5 and abs(row["ppl_change"] - 0.05) < 1e-12
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="empty holds neither"):
        frontier_plot.merged([tmp_path / "a", tmp_path / "empty"])


def test_frontier_eval_refuses_an_unknown_split(tmp_path):
    env = {**os.environ, "SPLIT": "depths"}
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "frontier_eval.sh"), "default", str(tmp_path), "full,int4"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert done.returncode == 2 and "SPLIT must be 'pipelines' or 'cells', got 'depths'" in done.stderr
