"""The GPU benchmark scripts keep working: decode_e2e.py's ``--smoke`` mode runs the same code path on a
tiny model on the CPU, including a batch grown from fewer encoder-filled rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_decode_e2e_smoke_grows_a_batch_from_filled_rows(tmp_path):
    command = [
        sys.executable, str(ROOT / "benchmarks" / "decode_e2e.py"), "--smoke", "--layers", "2", "--context", "256",
        "--batches", "1,3", "--fill-rows", "2", "--methods", "depthweave-kv", "--steps", "34", "--out", str(tmp_path),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT / "benchmarks")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    assert [r["batch"] for r in rows] == [1, 3]
    assert "filled_rows" not in rows[0] and rows[1]["filled_rows"] == 2
    # three rows store about three times the bytes of one (the grown rows are real copies; the rows'
    # residual entries differ with their contents), and both decoded
    assert 2.5 < rows[1]["cache_bytes"] / rows[0]["cache_bytes"] < 3.5
    assert all(r["median_step_ms"] > 0 for r in rows)
    assert "| depthweave-kv | 3 |" in (tmp_path / "decode_e2e.md").read_text()


def test_tp_capacity_smoke_finds_a_larger_batch_for_a_smaller_cache(tmp_path, monkeypatch, capsys):
    """benchmarks/tp_capacity.py's ``--smoke`` path in this process (one rank): the largest batch follows the
    cache bytes per sequence, a refused pipeline is a row saying why, and ``table`` merges the rows."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import tp_capacity

    out = tmp_path / "one"
    monkeypatch.setattr(sys, "argv", ["tp_capacity.py", "tp", "--smoke", "--layers", "2", "--contexts", "192", "--methods",
                                      "full,int4,minicache", "--steps", "3", "--probe-batch", "2", "--smoke-limit", "2000000",
                                      "--out", str(out)])
    tp_capacity.main()
    rows = {r["method"]: r for r in map(json.loads, (out / "rows.jsonl").read_text().splitlines())}
    full, int4 = rows["full"], rows["int4"]
    assert full["seq_bytes_per_gpu"] == 2 * 2 * 2 * 192 * 128 * 2  # K and V, 2 layers, 2 KV heads, 192 tokens, d = 128, bf16
    assert int4["seq_bytes_per_gpu"] < full["seq_bytes_per_gpu"] and int4["max_batch"] > full["max_batch"] >= 1
    assert full["max_batch"] * full["seq_bytes_per_gpu"] <= 2_000_000 < (full["max_batch"] + 1) * full["seq_bytes_per_gpu"]
    assert "refused" in rows["minicache"] and "minicache" in rows["minicache"]["refused"]
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["tp_capacity.py", "table", str(out)])
    tp_capacity.main()
    assert "| smoke | tp | 1 | 192 | int4 |" in capsys.readouterr().out
