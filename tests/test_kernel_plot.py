"""benchmarks/kernel_plot.py: the decode kernel's rows against the bar, as a table and a plot, from
lowbit_kernel.py's JSON files."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script():
    spec = importlib.util.spec_from_file_location("kernel_plot", ROOT / "benchmarks" / "kernel_plot.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(tokens: int, batch: int, speedup: float, of_copy: float, ratio: float) -> dict:
    return {"tokens": tokens, "batch": batch, "kernel": "dense:64:4:auto", "speedup": speedup, "of_copy": of_copy,
            "bytes_ratio": ratio, "sdpa_us": 100.0, "kernel_us": 100.0 / speedup}


def test_the_table_says_which_rows_meet_each_bar_and_the_plot_is_written(tmp_path, capsys):
    """Rows of two storages, one file holding the first storage's long rows apart: each row's bar is 0.7 times its own
    bytes ratio, a row at or past it meets it, one below does not, the bandwidth bar alike; the plot file is written."""
    plot = _script()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "lowbit_kernel.json").write_text(json.dumps({"rows": [_row(32768, 1, 2.0, 0.30, 10.0),
                                                                            _row(32768, 8, 7.0, 0.72, 10.0)]}))
    (tmp_path / "b.json").write_text(json.dumps({"storage": "wide-one", "rows": [_row(65536, 64, 3.4, 0.69, 4.8)]}))
    (tmp_path / "c.json").write_text(json.dumps({"rows": [_row(131072, 32, 6.99, 0.70, 10.0)]}))
    out = tmp_path / "plot.png"
    plot.main([str(tmp_path / "a" / "lowbit_kernel.json"), str(tmp_path / "b.json"), f"a={tmp_path / 'c.json'}",
               "--out", str(out)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "storage" not in line]
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert [(c[0], c[1], c[2], c[5], c[7]) for c in cells] == [
        ("a", "32768", "1", "no", "no"), ("a", "32768", "8", "yes", "yes"), ("a", "131072", "32", "no", "yes"),
        ("wide-one", "65536", "64", "yes", "no")]  # 3.4 >= 0.7 x 4.8; 6.99 < 7.0
    assert cells[0][4] == "7.00x" and cells[3][4] == "3.36x"
    assert out.stat().st_size > 10_000


def test_a_file_without_kernel_rows_and_bars_outside_zero_to_one_are_refused(tmp_path):
    plot = _script()
    (tmp_path / "x.json").write_text(json.dumps({"rows": [{"tokens": 1, "batch": 1}]}))
    with pytest.raises(SystemExit, match="holds no lowbit_kernel.py rows"):
        plot.main([str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="cannot read"):
        plot.main([str(tmp_path / "missing.json")])
    (tmp_path / "y.json").write_text(json.dumps({"rows": [_row(1024, 1, 1.0, 0.5, 2.0)]}))
    with pytest.raises(SystemExit, match="shares in"):
        plot.main([str(tmp_path / "y.json"), "--fraction", "1.5"])


def test_with_graph_the_bars_are_judged_on_the_graph_time_and_older_files_are_refused(tmp_path, capsys):
    """``--graph``: the speed-up is SDPA's graph time over the kernel's and the bandwidth the bytes over the kernel's
    graph time; a row slower on the profiler but faster from a graph meets the bar only with it; a file without graph
    times is refused by name."""
    plot = _script()
    row = {**_row(32768, 1, 6.0, 0.60, 10.0), "bytes_read": 14_000_000, "graph_us": 5.0, "graph_speedup": 7.5}
    (tmp_path / "g.json").write_text(json.dumps({"copy_bandwidth": 4.0e12, "rows": [row]}))
    for graph, met, share in ((False, "no", "60%"), (True, "yes", "70%")):  # 14 MB in 5 us: 2.8 TB/s of 4.0
        plot.main([f"g={tmp_path / 'g.json'}", "--out", str(tmp_path / "g.png")] + (["--graph"] if graph else []))
        line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| g ")][0]
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert (cells[3], cells[5], cells[6]) == (f"{7.5 if graph else 6.0:.2f}x", met, share)
    (tmp_path / "old.json").write_text(json.dumps({"rows": [_row(32768, 1, 6.0, 0.6, 10.0)]}))
    with pytest.raises(SystemExit, match="no graph times"):
        plot.main([str(tmp_path / "old.json"), "--graph"])


def test_one_configuration_of_a_file_is_a_line_of_its_own(tmp_path, capsys):
    """``PATH@KERNEL`` keeps one configuration's rows of a file holding several (one ``--configs`` run); a kernel the file
    does not hold is refused with the ones it does."""
    plot = _script()
    capped = {**_row(32768, 8, 6.0, 0.6, 10.0), "kernel": "dense:64:4:auto:r128"}
    (tmp_path / "r.json").write_text(json.dumps({"rows": [_row(32768, 8, 4.0, 0.4, 10.0), capped]}))
    plot.main([f"plain={tmp_path / 'r.json'}@dense:64:4:auto", f"capped={tmp_path / 'r.json'}@dense:64:4:auto:r128",
               "--out", str(tmp_path / "p.png")])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "storage" not in line]
    assert [[cell.strip() for cell in line.strip("|").split("|")][:4] for line in lines] == [
        ["plain", "32768", "8", "4.00x"], ["capped", "32768", "8", "6.00x"]]
    with pytest.raises(SystemExit, match=r"no rows of kernel 'wide:32:4:auto' \(it holds dense:64:4:auto, dense:64:4:auto:r128\)"):
        plot.main([f"{tmp_path / 'r.json'}@wide:32:4:auto", "--out", str(tmp_path / "q.png")])
