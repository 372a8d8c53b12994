"""benchmarks/kernel_sass.py --method depthweave-kv: depthweave-kv's tiles pass built for sm_90 without a GPU, as its
decode call launches it on one (the hardware population counts of ``ASM``), counted like the lowbit launches, its
spills (local-memory loads and stores) among its opcodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvweave.kernels.gpu_build import nvdisasm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_the_tiles_pass_is_built_as_a_gpu_launches_it_and_counted(tmp_path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--method", "depthweave-kv",
                           "--tokens", "512", "--out", str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())
    assert (row["storage"], row["config"], row["tokens"]) == ("depthweave-kv", "tiles:", 512)
    assert row["opcodes"].get("POPC", 0) > 0  # the GPU's population counts, not the portable bit arithmetic
    assert row["tensor"] > 0 and 0 < row["loop"] < row["total"] and row["registers"] > 0
    assert row["spills"] == row["opcodes"].get("STL", 0) + row["opcodes"].get("LDL", 0)
    assert row["loop_spills"] == row["loop_opcodes"].get("STL", 0) + row["loop_opcodes"].get("LDL", 0)
    assert "| depthweave-kv | `tiles:` |" in done.stdout
