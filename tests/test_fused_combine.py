"""The ``lowbit`` combine done by the dense kernel's own programs (``FUSE``, ``kvweave.kernels.lowbit_combine.
fused_combine``): which launches take it, its output against the two launches' and the twin's under Triton's
interpreter (CI), the counts it leaves behind, its sm_90 build, and on a GPU the output at real sizes and replayed from
a CUDA graph."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.kernels import lowbit_combine
from kvweave.kernels.lowbit_combine import fused_combine, fused_counters, fused_refusal
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_combine, plan_launch, torch_lowbit_decode
from kvweave.plugins.quantizers.rotated_token import rotation_matrix

from test_combine_hadamard import _sinks_view
from test_lowbit_kernel_host import _nvidia_backend

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sinks_view():
    return _sinks_view(128)


def _plans(view, q, start=None):
    packed = plan_launch(view, q, start, q.shape[-1] ** -0.5, variant="dense")
    return packed, plan_combine(view, q, start, q.shape[-1] ** -0.5, packed)


def test_the_launch_folds_the_combine_in_where_it_can_and_says_why_not_elsewhere(sinks_view, monkeypatch):
    """The dense kernel's pass over a Hadamard rotation takes the combine (same grid, the combine's output, FUSE on
    and no early combine); the setting at 0, a one-wave pass launched with an early combine (setting 1; 2 takes it
    there too), a rotation read as a matrix, and another kernel's pass are refused, each with its reason."""
    view = sinks_view
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    packed, combine = _plans(view, q)
    fused = fused_combine(view, packed, combine)
    assert fused is not None and fused.grid == packed.grid and fused.outputs == combine.outputs
    assert fused.constants["FUSE"] and not fused.constants["PDL"] and fused.constants["HAD"] == 7
    assert fused.constants["QR"] == 4 and packed.outputs[0].shape[1] == packed.grid[1] + 1  # the exact tokens' slot
    early = attrs.evolve(packed, constants={**packed.constants, "PDL": True})
    assert "one wave" in fused_refusal(view, early)
    monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 2)
    assert fused_refusal(view, early) is None
    assert "not undone by a transform" in fused_refusal(attrs.evolve(view, rotation_hadamard=False), packed)
    assert "not the dense kernel's" in fused_refusal(view, attrs.evolve(packed, kernel=lowbit_combine.jit._lowbit_combine_kernel))
    monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 0)
    assert fused_refusal(view, packed) == "KVWEAVE_FUSED_COMBINE=0" and fused_combine(view, packed, combine) is None


def test_the_setting_refuses_values_it_does_not_know(monkeypatch):
    monkeypatch.setenv("KVWEAVE_FUSED_COMBINE", "3")
    with pytest.raises(ValueError, match="KVWEAVE_FUSED_COMBINE='3'"):
        lowbit_combine.env_setting("KVWEAVE_FUSED_COMBINE", 1, (0, 1, 2))


def test_the_counters_grow_and_keep_what_a_graph_may_hold():
    """A device's counters are zero, one a row; a longer need makes a new buffer and keeps the old one (a CUDA graph
    captured with it keeps using it)."""
    device = torch.device("cpu")
    lowbit_combine._COUNTERS.pop(str(device), None)
    small = fused_counters(device, 10)
    assert small.dtype == torch.int32 and small.shape == (10,) and not small.any()
    assert fused_counters(device, 200).data_ptr() == small.data_ptr()  # 256 made at first
    large = fused_counters(device, 600)
    assert large.shape == (600,) and large.data_ptr() != small.data_ptr()
    assert len(lowbit_combine._COUNTERS[str(device)]) == 2


@pytest.mark.interpreter
@pytest.mark.parametrize("q_heads", [8, 6])
def test_one_launch_gives_the_two_launches_output(sinks_view, monkeypatch, q_heads):
    """Restored sinks and the exact window, with and without a first visible position, float32 and the model's
    dtype, one and three query heads a KV head (3: a padded row): the fused launch's output is the two launches' to
    float32 rounding and the twin's within its tolerance, every count is back at zero after it, and a second call
    gives the same output."""
    view = sinks_view
    q = torch.randn(1, q_heads, 128, generator=torch.Generator().manual_seed(q_heads))
    scaling = 128 ** -0.5
    for start in (None, torch.tensor([30], dtype=torch.int32)):
        monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 0)
        apart = lowbit_decode(view, q, start, scaling, variant="dense")
        monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 2)
        assert fused_combine(view, *_plans(view, q, start)) is not None
        one = lowbit_decode(view, q, start, scaling, variant="dense")
        assert torch.allclose(one, apart, atol=2e-6, rtol=0), (one - apart).abs().max()
        twin = torch_lowbit_decode(view, q, start, scaling)
        assert torch.allclose(one, twin, atol=1e-5), (one - twin).abs().max()
        assert not lowbit_combine._COUNTERS["cpu"][-1].any()
        assert torch.equal(lowbit_decode(view, q, start, scaling, variant="dense"), one)
        low = lowbit_decode(view, q, start, scaling, variant="dense", out_dtype=torch.bfloat16)
        assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), one, atol=1e-2)


@pytest.mark.interpreter
def test_a_count_that_does_not_start_at_zero_combines_too_early(sinks_view, monkeypatch):
    """What the counts guard: a row whose count starts at one has its combine done by the program before its last,
    which misses a split (the output moves) and leaves the count at one; the other rows are unchanged. So a launch
    that did not count, or a count not set back, would fail the test above."""
    monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 2)
    view = sinks_view
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    packed, combine = _plans(view, q)
    assert packed.grid[1] >= 2
    right = lowbit_decode(view, q, None, 128 ** -0.5, variant="dense")
    fused_counters(q.device, packed.grid[0])[0] = 1
    wrong = fused_combine(view, packed, combine).run()[0]
    rows = q.shape[1] // view.exact_k.shape[1]
    assert (wrong[:, :rows] - right[:, :rows]).abs().max() > 1e-3
    assert torch.equal(wrong[:, rows:], right[:, rows:])
    counts = fused_counters(q.device, packed.grid[0])
    assert counts[0] == 1 and not counts[1:].any()
    counts.zero_()


@pytest.mark.interpreter
def test_a_rotation_flagged_hadamard_that_is_not_changes_the_output(sinks_view, monkeypatch):
    """The fused launch undoes the rotation by the transform: a random rotation flagged Hadamard gives another output
    than the matrix would (so a transform skipped, or the matrix read instead, would be seen)."""
    monkeypatch.setattr(lowbit_combine, "FUSED_COMBINE", 2)
    wrong = attrs.evolve(sinks_view, rotation=rotation_matrix("random", 1, 128))
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    fast = lowbit_decode(wrong, q, None, 128 ** -0.5, variant="dense")
    slow = lowbit_decode(attrs.evolve(wrong, rotation_hadamard=False), q, None, 128 ** -0.5, variant="dense")
    assert (fast - slow).abs().max() > 1e-3


_SASS = """
import importlib, json, sys, attrs, torch
sys.path.insert(0, "benchmarks")
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view
from kvweave.kernels.gpu_build import branches, build, launch_job, sass_listing
from kvweave.kernels.lowbit_combine import fused_combine, plan_combine
from kvweave.kernels.lowbit_decode import plan_launch
from kvweave.kernels.lowbit_dense import ampere_products
view = attrs.evolve(packed_view(8, 32768, device="cpu", storage="k4v2e48t"), inv_freq=None)
q = torch.randn(8, Q_HEADS, HEAD_DIM)
packed = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", lowp=True, programs=None)
fused = fused_combine(view, packed, plan_combine(view, q, None, HEAD_DIM ** -0.5, packed))
found = {"registers": fused.constants["maxnreg"], "ampere": ampere_products(torch.device("cpu"))}
for name, launch in (("apart", packed), ("fused", fused)):
    job = launch_job(launch.kernel, launch.args, launch.constants)
    code, labels = sass_listing(build(importlib.import_module(job["module"]), job).asm["cubin"])
    spans = [(to, at) for at, to, _ in branches(code, labels) if to < at]
    inner = [span for span in spans if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in spans)]
    loops = [[op for address, op, _, _ in code if lo <= address <= hi] for lo, hi in inner]
    steps = [loop for loop in loops if "HMMA" in loop or "HGMMA" in loop]  # the token loop: the one with products
    found[name] = {"loops": len(steps), "loop": steps[0] if steps else [],
                   "atomics": sum(op.startswith("ATOM") or op == "RED" for _, op, _, _ in code)}
print(json.dumps(found))
"""


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
def test_the_sm90_build_keeps_the_token_loop_as_it_was():
    """Built for sm_90 at the registers of a launch past one wave (96), the fused kernel has one token loop (the loop
    with tensor-core products), making the two launches' products, and one atomic, the count. On a Triton that builds
    Ampere products (before 3.8: the GPU machine's, whose build the 96 registers were timed with) that loop reads and
    writes no local memory: a branch around the steps, the first way this was built, spilled in them. Later Tritons'
    warpgroup builds spill a little in the two launches' loop too, so there the loop is not checked for it."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _SASS], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    loop, apart = found["fused"]["loop"], found["apart"]["loop"]
    assert found["registers"] == 96 and found["fused"]["atomics"] == 1 and found["apart"]["atomics"] == 0
    assert found["fused"]["loops"] == found["apart"]["loops"] == 1
    products = lambda ops: ops.count("HMMA") + ops.count("HGMMA")  # noqa: E731
    assert products(loop) == products(apart) > 0
    if found["ampere"]:
        assert "LDL" not in loop and "STL" not in loop


_GPU = """
import sys, attrs, torch
sys.path.insert(0, "benchmarks")
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view
from kvweave.kernels import lowbit_combine
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_combine, plan_launch
worst = 0.0
for storage in ("k4v2e48t", "k4v4e77t"):
    for rows in (1, 8, 32, 40):
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)).cuda()
        lowbit_combine.FUSED_COMBINE = 0
        apart = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        lowbit_combine.FUSED_COMBINE = 2
        packed = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        assert lowbit_combine.fused_combine(view, packed, plan_combine(view, q, None, HEAD_DIM ** -0.5, packed))
        for _ in range(3):
            one = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
            assert float(one.abs().max()) > 0.05
            worst = max(worst, float((one - apart).abs().max() / apart.abs().max()))
        assert not lowbit_combine._COUNTERS["cuda:0"][-1].any()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        for _ in range(3):
            captured.zero_()
            graph.replay()
            torch.cuda.synchronize()
            worst = max(worst, float((captured - apart).abs().max() / apart.abs().max()))
        assert not lowbit_combine._COUNTERS["cuda:0"][-1].any()
print(worst)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the fused launch for a CUDA GPU")
def test_one_launch_gives_the_two_launches_output_on_the_gpu():
    """Llama-3-8B attention shape, 32,768 tokens before eviction, both classes' storages, B = 1, 8, 32 and 40, the
    launch's own splits: three eager calls and three replays of a captured one give the two launches' output up to
    float32 rounding (1e-5 of its largest value), and leave every count at zero."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _GPU], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) <= 1e-5
