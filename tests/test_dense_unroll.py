"""The dense kernel's token loop unrolled by two (``UNROLL``, KVWEAVE_DENSE_UNROLL=2) with room for it at one wave
(KVWEAVE_DENSE_WAVE_REGISTERS=168: 3 programs an SM): the settings checked by name, the sm_90 build without a GPU
(two steps a loop iteration, within the register cap), and the outputs against the loop as it is on a GPU. Both
settings are read when the modules are imported, so each build runs in a process of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvweave.kernels.gpu_build import nvdisasm

ROOT = Path(__file__).resolve().parents[1]
UNROLLED = {"KVWEAVE_DENSE_UNROLL": "2", "KVWEAVE_DENSE_WAVE_REGISTERS": "168"}


def _env(**extra: str) -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | extra


@pytest.mark.parametrize("name, value, expected", [("KVWEAVE_DENSE_UNROLL", "3", "1, 2"),
                                                   ("KVWEAVE_DENSE_WAVE_REGISTERS", "160", "128, 168")])
def test_a_setting_out_of_its_values_is_refused_by_name(name, value, expected):
    done = subprocess.run([sys.executable, "-c", "import kvweave.kernels.lowbit_dense_triton, kvweave.kernels.lowbit_dense"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(**{name: value}))
    assert done.returncode != 0
    assert f"{name}={value!r}: expected one of {expected}" in done.stderr


def _sass_row(tmp_path: Path, tag: str, env: dict) -> dict:
    out = tmp_path / f"{tag}.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--storages", "k4v2e48t-post",
                           "--configs", "dense:", "--out", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())[0]


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_the_unrolled_loop_runs_two_steps_an_iteration_within_the_register_cap(tmp_path):
    """Built for sm_90 as a launch of one wave makes it (benchmarks/kernel_sass.py): unrolled, the token loop holds
    twice the tensor-core products of the loop as it is, and the build keeps to 168 registers a thread where the one as
    it is keeps to 128. A launch outside the one-wave rule (KVWEAVE_DENSE_AHEAD=0 turns the rule off: no value words a
    step ahead, 96 registers) keeps its loop as it is."""
    plain = _sass_row(tmp_path, "plain", _env())
    unrolled = _sass_row(tmp_path, "unrolled", _env(**UNROLLED))
    off = _sass_row(tmp_path, "off", _env(**UNROLLED, KVWEAVE_DENSE_AHEAD="0"))
    products = lambda row: sum(row["loop_opcodes"].get(op, 0) for op in ("HMMA", "HGMMA"))  # noqa: E731
    assert products(plain) > 0 and products(unrolled) == 2 * products(plain) and products(off) == products(plain)
    assert plain["registers"] <= 128 < unrolled["registers"] <= 168 and off["registers"] <= 96


_OUTPUTS = """
import sys, attrs, torch
sys.path.insert(0, "benchmarks")
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view
from kvweave.kernels.lowbit_decode import lowbit_decode
outs = {}
for storage in ("k4v2e48t", "k4v4e77t"):
    for rows in (1, 8):
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)).cuda()
        outs[f"{storage}-{rows}"] = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None).cpu()
torch.save(outs, sys.argv[1])
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernel for a CUDA GPU")
def test_the_unrolled_loop_gives_the_loops_output_on_the_gpu(tmp_path):
    """Llama-3-8B attention shape, 32,768 tokens before eviction, keys after RoPE, both storages: at one row (one wave:
    5 steps a program, so an iteration of two steps and one left over) and at 8 rows (outside the rule: the loop as it
    is), the build with both settings writes the output of the build without, up to rounding the compiler may order
    otherwise. One process a build, each over every case."""
    outs = []
    for tag, env in (("plain", _env()), ("unrolled", _env(**UNROLLED))):
        path = tmp_path / f"{tag}.pt"
        done = subprocess.run([sys.executable, "-c", _OUTPUTS, str(path)], capture_output=True, text=True, timeout=900,
                              cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        outs.append(torch.load(path))
    plain, unrolled = outs
    assert sorted(plain) == sorted(unrolled) and len(plain) == 4
    for case, out in plain.items():
        assert float(out.abs().max()) > 0.05, case
        assert float((unrolled[case] - out).abs().max()) <= 1e-5 * float(out.abs().max()), case
