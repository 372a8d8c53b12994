"""benchmarks/profile_decode.py (where a decode step's time and memory go) and decode_e2e.py's ``--registry``: the smoke
paths on the CPU (the scripts' ``main()`` in this process, run from the repository's root), and the peak-allocation
reading of an allocator history."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvweave.core.errors import KvweaveError

from test_benchmark_scripts import run_main  # noqa: F401 - the fixture that runs a benchmark script's main() here

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def run_script(run_main, capsys):  # noqa: F811 - the fixture imported above
    """``run_script(NAME, *options)``: benchmarks/NAME.py's main() with ``options``, from the repository's root; what it
    printed."""

    def run(name: str, *options: str) -> str:
        capsys.readouterr()
        run_main(name, *options, cwd=ROOT)
        return capsys.readouterr().out

    return run


def test_decode_e2e_reads_pipelines_from_a_user_registry(tmp_path, run_script):
    """The head_dim-128 pipelines of dense_sweep.toml run on the Llama-3-8B head shape through ``--registry``, store
    several times fewer bytes than the full cache, and an unknown name is not silently skipped."""
    run_script("decode_e2e", "--smoke", "--layers", "2", "--context", "512", "--batches", "1", "--steps", "3",
               "--methods", "full,kzd-k4v2-f48-d128", "--registry", "benchmarks/dense_sweep.toml", "--out", str(tmp_path))
    rows = {r["method"]: r for r in map(json.loads, (tmp_path / "rows.jsonl").read_text().splitlines())}
    assert rows["full"]["cache_bytes"] > 5 * rows["kzd-k4v2-f48-d128"]["cache_bytes"] > 0
    with pytest.raises(KvweaveError, match="kzd-k4v2-f48-d128"):  # not in the built-in registry
        run_script("decode_e2e", "--smoke", "--layers", "2", "--context", "256", "--batches", "1", "--methods", "kzd-k4v2-f48-d128",
                   "--out", str(tmp_path / "x"))


def test_profile_decode_smoke_prints_the_steps_host_operations(run_script):
    out = run_script("profile_decode", "--smoke", "--layers", "2", "--context", "512", "--batch", "2", "--steps", "3",
                     "--top", "8", "--method", "kzd-k4v2-f48-d128", "--shapes")
    assert "# kzd-k4v2-f48-d128, B = 2, context 512, 3 profiled steps, cpu; median step" in out
    table = out.split("| host operation (self time) |")[1].split("| operation | input shapes |")[0].splitlines()
    assert len([line for line in table if line.startswith("| `aten::")]) >= 3
    shaped = out.split("| operation | input shapes | calls per step | host (self) us per step |")[1].splitlines()
    assert len([line for line in shaped if line.startswith("| `aten::") and "[[2, " in line]) >= 1  # B = 2's tensors


def test_peak_allocations_are_those_live_at_the_highest_point(monkeypatch):
    """Of an allocator history: what was live when the most was held (not at the end, not everything ever made),
    summed by the first kvweave source line of each stack."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from profile_decode import peak_allocations

    def at(name: str) -> list[dict]:
        return [{"filename": "/site/torch/x.py", "line": 1, "name": "f"}, {"filename": f"/src/kvweave/engine/{name}", "line": 7, "name": "g"}]

    trace = [{"action": "alloc", "addr": 1, "size": 300, "frames": at("a.py")},
             {"action": "alloc", "addr": 2, "size": 500, "frames": at("b.py")},
             {"action": "alloc", "addr": 3, "size": 100, "frames": at("b.py")},
             {"action": "free_completed", "addr": 2, "size": 500},
             {"action": "alloc", "addr": 4, "size": 200, "frames": at("c.py")}]
    lines = peak_allocations({"device_traces": [trace]})
    assert lines[0].endswith(f"{900 / 1e9:.2f} GB")
    rows = [line for line in lines if line.startswith("| `")]
    assert rows[0].startswith("| `b.py:7 g` | 0.000 | 2 |") and rows[1].startswith("| `a.py:7 g`")
    assert not [row for row in rows if "c.py" in row]  # made after the peak


def test_scoring_check_agreement_on_the_cpu_is_exact(run_script):
    """On the CPU in float32 the scoring path's own attention (lower-right causal) and the model's sdpa with its mask
    give the same scores: the script reports no difference and the same top half."""
    out = run_script("scoring_check", "agreement", "--smoke", "--tokens", "500", "--layers", "2")
    assert "relative difference largest 0, median 0; top half picked by both (layers 1-): 100.0%" in out
