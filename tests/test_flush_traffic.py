"""benchmarks/flush_traffic.py, in this process: the trace of one flush names the passes the sketch and the encoder make
over the block, and ``compare`` tells a tree that stores the same bits from one that does not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "flush_traffic.py"


def _script():
    spec = importlib.util.spec_from_file_location("flush_traffic", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_trace_of_a_flush_counts_its_passes_over_the_block(capsys):
    _script().traffic(64)
    out = capsys.readouterr().out
    rows = [line.split("|") for line in out.splitlines() if line.startswith("| ") and not line.startswith("| float32")]
    assert any("plugins/bases/sketch_ema.py" in row[4] and row[3].strip().startswith("div") for row in rows)  # scaled rows
    assert any("engine/encoder.py" in row[4] and row[3].strip().startswith("sub") for row in rows)  # the difference
    total = float(out.strip().splitlines()[-1].split()[0])
    assert abs(total - sum(float(row[1]) for row in rows)) < 0.005 * len(rows) + 0.05


def test_compare_says_whether_the_stored_bits_are_the_same(tmp_path, monkeypatch, capsys):
    script = _script()
    held = {name: ([torch.arange(6.0), torch.ones(2, dtype=torch.int8)], torch.tensor([[1, 2]]), {"coefficients": 8})
            for name in script.PIPELINES}
    monkeypatch.setattr(script, "stored", lambda: held)
    saved = tmp_path / "before.pt"
    monkeypatch.setattr(sys, "argv", ["flush_traffic.py", "save", str(saved)])
    script.main()
    monkeypatch.setattr(sys, "argv", ["flush_traffic.py", "compare", str(saved)])
    script.main()
    assert capsys.readouterr().out.count("bit for bit the same: True; the same tokens: True; the same bytes by part: True") == 3
    held[script.PIPELINES[0]][0][0][5] += 1e-6
    script.main()
    lines = capsys.readouterr().out.splitlines()
    assert "bit for bit the same: False" in lines[0] and all("bit for bit the same: True" in line for line in lines[1:])
