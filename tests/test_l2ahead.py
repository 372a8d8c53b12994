"""Codes asked of the L2 cache steps ahead (:mod:`kvweave.kernels.prefetch_triton`): by the lowbit dense kernel (the
tricks ``l2aheadN``) and by depthweave-kv's tiles pass
(``KVWEAVE_TILES_L2AHEAD``): the tricks and the launch on any machine, the prefetch instructions in the sm_90
builds without a GPU, and the outputs unchanged by them on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvweave.kernels.gpu_build import nvdisasm
from kvweave.kernels.lowbit_tricks import parse_tricks

ROOT = Path(__file__).resolve().parents[1]


def test_the_l2ahead_tricks_name_the_steps_and_are_the_dense_kernels_alone():
    assert parse_tricks("", "dense", True)["L2AHEAD"] == 0
    assert parse_tricks("l2ahead4", "dense", True)["L2AHEAD"] == 4
    assert parse_tricks("l2ahead8+r128", "dense", True)["L2AHEAD"] == 8
    with pytest.raises(ValueError, match="one 'l2aheadN' at most"):
        parse_tricks("l2ahead2+l2ahead4", "dense", True)
    with pytest.raises(ValueError, match="launch settings of the 'dense' kernel"):
        parse_tricks("l2ahead4", "wide", True)
    with pytest.raises(ValueError, match="expected '\\+'-separated names"):
        parse_tricks("l2ahead3", "dense", True)


def test_the_launch_asks_the_l2_cache_ahead_only_where_a_trick_says(monkeypatch):
    """No launch asks for a prefetch by itself (slower at every shape timed); a trick asks on a GPU build only, where
    the kernel has inline PTX (``ASM``): the interpreter's launch keeps ``AHEAD`` below 4."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attrs
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    from kvweave.kernels.lowbit_decode import plan_launch

    view = attrs.evolve(packed_view(1, 1024, device="cpu", storage="k4v2e48t"), inv_freq=None)
    q = torch.randn(1, Q_HEADS, HEAD_DIM)
    plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense")  # the kernels' modules imported for the interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # then planned as for a GPU build (no kernel runs here)
    builds = set()
    for tricks in ("", "l2ahead4"):
        for lowp in (False, True):  # lowp: the bfloat16 operands and inline assembly of a GPU build
            launch = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", lowp=lowp, tricks=tricks)
            gpu = launch.constants["ASM"] > 0
            builds.add(gpu)
            assert launch.constants["AHEAD"] // 4 == (4 if tricks and gpu else 0), (tricks, lowp)
            assert launch.constants["AHEAD"] % 4 == 2  # the value tiles' words a step ahead, as without
    assert builds == {False, True}


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
@pytest.mark.parametrize("bulk, opcode, loop, build", [("1", "UBLKPF", 2, 4), ("0", "CCTL", 2, 8)])
def test_the_sm90_build_asks_for_a_steps_key_and_value_codes_once_a_step(tmp_path, bulk, opcode, loop, build):
    """Built for sm_90 without a GPU (benchmarks/kernel_sass.py, a process of its own): with ``l2ahead4`` the token
    loop holds one prefetch for the key words and one for the value words; before it, as bulk requests
    (``UBLKPF``), one a stream for the first steps, or line by line (``CCTL``, ``KVWEAVE_BULK_PREFETCH=0``), one a
    stream and step; without it none. The inline PTX assembles (ptxas refuses a wrong operand)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"KVWEAVE_BULK_PREFETCH": bulk}
    out = tmp_path / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--storages", "k4v2e48t-post",
                           "--configs", "dense:,dense:l2ahead4", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["config"]: row for row in json.loads(out.read_text())}
    plain, ahead = rows["dense:"], rows["dense:l2ahead4"]
    assert not {"CCTL", "UBLKPF"} & set(plain["opcodes"])
    assert ahead["loop_opcodes"].get(opcode) == loop and ahead["opcodes"].get(opcode) == build
    assert ahead["tensor"] == plain["tensor"] > 0  # the same tensor-core products


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernel for a CUDA GPU")
@pytest.mark.parametrize("storage", ["k4v2e48t", "k4v4e77t"])
@pytest.mark.parametrize("rows", [1, 8])
def test_the_l2_prefetch_changes_no_output_on_the_gpu(storage, rows):
    """Llama-3-8B attention shape, 32,768 tokens before eviction, keys after RoPE: the output with each step's codes
    asked of the L2 cache 2, 4 or 8 steps ahead is the output without (a prefetch reads nothing), at one row (one
    wave) and at 8."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import attrs
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch

    view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
    q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)).cuda()
    plain = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
    for steps in (2, 4, 8):
        launch = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None, tricks=f"l2ahead{steps}")
        assert launch.constants["AHEAD"] // 4 == steps
        out = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None, tricks=f"l2ahead{steps}")
        # the same arithmetic: equal but for where the compiler's scheduling around the prefetches rounds otherwise
        assert float((out - plain).abs().max()) <= 1e-5 * float(plain.abs().max()), (storage, rows, steps)


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
@pytest.mark.parametrize("bulk, instruction", [("1", "cp.async.bulk.prefetch.L2"), ("0", "prefetch.global.L2")])
def test_the_tiles_pass_asks_for_its_coefficients_lines_only_when_told(tmp_path, monkeypatch, bulk, instruction):
    """depthweave-kv's tiles pass built for sm_90 as a GPU launch makes it (in a process of its own, which reads
    ``KVWEAVE_BULK_PREFETCH``): with ``L2AHEAD`` its PTX asks the L2 cache for its coefficients, in bulk requests or
    line by line, and ptxas assembles it; without, it asks for none. The interpreter's launch passes 0 (no inline
    PTX)."""
    from test_lowbit_kernel_host import compile_job
    from test_tiles_pass import recorded_tiles_job

    job, constants = recorded_tiles_job(tmp_path)
    assert constants["L2AHEAD"] == 0
    monkeypatch.setenv("KVWEAVE_BULK_PREFETCH", bulk)
    texts = []
    for steps in (0, 4):
        job["constants"].update(ASM=True, BYTES=True, WORDS=2, L2AHEAD=steps)
        texts.append(compile_job(job)["ptx_text"])
    assert "prefetch" not in texts[0] and texts[1].count(instruction) >= 4
