"""benchmarks/layer_mix.py: a pipeline's cells weighed from one run a kind of layer, and its refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import layer_mix  # noqa: E402


def _run(storage: str, kernel_us: float, read: int, full: int = 1_000_000, sdpa: float = 100.0, cells=((32768, 1),),
         shape: str = "llama3-8b") -> dict:
    rows = [{"tokens": t, "batch": b, "kernel": "dense:64:4:auto", "sdpa_us": sdpa, "kernel_us": kernel_us,
             "sdpa_graph_us": sdpa, "graph_us": kernel_us, "bytes_read": read, "bytes_ratio": full / read}
            for t, b in cells]
    return {"storage": storage, "shape": shape, "device": "GPU", "date": "2026-12-07", "copy_bandwidth": 3e12,
            "rows": rows}


def test_a_run_weighed_with_itself_gives_its_own_figures():
    run = _run("a", 20.0, 125_000)
    (cell,) = layer_mix.mix([(run, 22), (run, 8)])
    assert cell["graph_speedup"] == pytest.approx(5.0) and cell["bytes_ratio"] == pytest.approx(8.0)
    assert cell["bar"] == pytest.approx(5.6) and cell["of_copy"] == pytest.approx(125_000 / 20e-6 / 3e12)


def test_the_layers_add_their_times_and_bytes():
    """22 layers of 10 us and 100,000 bytes, 8 of 30 us and 200,000: a step's time and bytes are the sums, so the
    pipeline's speed-up is 30 x SDPA over (22 x 10 + 8 x 30), not the mean of the two speed-ups."""
    (cell,) = layer_mix.mix([(_run("v2", 10.0, 100_000), 22), (_run("v4", 30.0, 200_000), 8)])
    assert cell["graph_us"] == pytest.approx((22 * 10 + 8 * 30) / 30)
    assert cell["graph_speedup"] == pytest.approx(30 * 100 / (22 * 10 + 8 * 30))
    assert cell["bytes_ratio"] == pytest.approx(30 * 1_000_000 / (22 * 100_000 + 8 * 200_000))
    mean_of_speedups = (22 * 100 / 10 + 8 * 100 / 30) / 30
    assert cell["graph_speedup"] < mean_of_speedups - 1


def test_only_the_cells_every_run_has_are_weighed():
    cells = layer_mix.mix([(_run("a", 10.0, 100_000, cells=((32768, 1), (65536, 1))), 1),
                           (_run("b", 10.0, 100_000, cells=((65536, 1),)), 1)])
    assert [(c["tokens"], c["batch"]) for c in cells] == [(65536, 1)]


def test_runs_of_other_shapes_or_caches_are_refused():
    with pytest.raises(SystemExit, match="attention shape"):
        layer_mix.mix([(_run("a", 10.0, 100_000), 1), (_run("b", 10.0, 100_000, shape="d256"), 1)])
    with pytest.raises(SystemExit, match="full caches differ"):
        layer_mix.mix([(_run("a", 10.0, 100_000), 1), (_run("b", 10.0, 100_000, full=2_000_000), 1)])
    with pytest.raises(SystemExit, match="no .* cell in common"):
        layer_mix.mix([(_run("a", 10.0, 100_000), 1), (_run("b", 10.0, 100_000, cells=((65536, 8),)), 1)])


@pytest.mark.parametrize("part", ["x.json", "x.json:0", "x.json:two"])
def test_a_part_without_a_layer_count_is_refused_by_name(part):
    with pytest.raises(SystemExit, match="expected PATH:LAYERS"):
        layer_mix.parse_part(part)


def test_the_command_prints_the_table(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_run("k4v2e40t-post", 10.0, 100_000)))
    b.write_text(json.dumps(_run("k4v4e40t-post", 30.0, 200_000)))
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_mix.py"), f"{a}:22", f"{b}:8"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert "22 x k4v2e40t-post + 8 x k4v4e40t-post" in done.stdout
    row = [line for line in done.stdout.splitlines() if line.startswith("| 32768 | 1 |")]
    assert len(row) == 1 and f"{30 * 100 / (22 * 10 + 8 * 30):.2f}x" in row[0] and "missed" in row[0]
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "layer_mix.py"), f"{bad}:1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "not a lowbit_kernel.json" in done.stderr


def test_the_share_of_copy_bandwidth_from_the_graph_time_decides_the_bar_with_graph():
    """A layer whose GPU time reads at 60% of copy bandwidth and whose graph time at 75%: the bandwidth bar missed from
    the GPU time, met with ``graph``, as kernel_plot.py --graph takes it."""
    run = _run("a", 10.0, 100_000, full=1_000_000, sdpa=100.0)
    run["rows"][0].update(kernel_us=100_000 / 0.6 / 3e12 * 1e6, graph_us=100_000 / 0.75 / 3e12 * 1e6, sdpa_graph_us=1000.0)
    (cell,) = layer_mix.mix([(run, 1)])
    assert cell["of_copy"] == pytest.approx(0.6) and cell["of_copy_graph"] == pytest.approx(0.75)
    assert layer_mix.table([cell]).endswith("| 60% | missed |")
    assert layer_mix.table([cell], graph=True).endswith("| 75% | met |")
