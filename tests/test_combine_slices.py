"""The ``lowbit`` combine with a query head's output channels in slices (``COMBINE_SLICES``: each slice's program
computes the weights, reads only its channels' values, outputs and rotation columns): the output of one program a query
head, under Triton's interpreter (CI) and on a GPU at a real size; its settings from the environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, importance
from kvweave.kernels import lowbit_combine
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_combine, plan_launch, torch_lowbit_decode

from conftest import CharTokenizer, tiny_llama

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "dense_sweep.toml"


@pytest.fixture(scope="module")
def sinks_view():
    """Layer 1 of two 300-token prompts through the 8x storage with values in tiles (head_dim 128): sinks restored
    exactly, an exact window, a rotation of the values."""
    registry = load_registry(SWEEP)
    net = tiny_llama(layers=2, hidden=512)
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    cache = build_cache(registry.resolve("kzd-k4v2t-f48-d128"), net, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(net, cache, ids)
    return cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))


@pytest.fixture(scope="module")
def packed_passes(sinks_view):
    """A query and, per first visible position (none, 30), the dense kernel's packed pass over ``sinks_view`` as
    ``lowbit_decode`` launches it, run once (the combine's settings change only the combine, which reads the pass's
    outputs and writes its own), with the one-program-a-query-head combine's output of it and the twin's output."""
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    runs = []
    for start in (None, torch.tensor([30], dtype=torch.int32)):
        assert lowbit_combine.COMBINE_SLICES == 1
        packed = plan_launch(sinks_view, q, start, 128 ** -0.5, variant="dense")
        packed.run()
        whole = plan_combine(sinks_view, q, start, 128 ** -0.5, packed).run()[0]
        runs.append((start, packed, whole, torch_lowbit_decode(sinks_view, q, start, 128 ** -0.5)))
    return q, runs


@pytest.mark.interpreter
@pytest.mark.parametrize("slices, warps", [(2, 4), (4, 4), (8, 2), (4, 8)])
def test_a_combine_in_slices_gives_the_one_program_output(sinks_view, packed_passes, monkeypatch, slices, warps):
    """Restored sinks, the exact window, the splits rotated back: each slice's channels as one program a query head
    gives them (float32 sums in other tiles: to 1e-6), in the model's dtype too, with and without a first visible
    position, and within the twin's rounding."""
    view = sinks_view
    assert view.restored_k is not None and view.rotation is not None and view.exact_k.shape[-2] > 0
    q, runs = packed_passes
    for start, packed, whole, twin in runs:
        monkeypatch.setattr(lowbit_combine, "COMBINE_SLICES", slices)
        monkeypatch.setattr(lowbit_combine, "COMBINE_WARPS", warps)
        combine = plan_combine(view, q, start, 128 ** -0.5, packed)
        assert combine.grid == (8 * slices,) and combine.constants["SLICES"] == slices
        assert combine.constants["num_warps"] == warps
        sliced = combine.run()[0]
        rounded = plan_combine(view, q, start, 128 ** -0.5, packed, torch.bfloat16).run()[0]
        monkeypatch.undo()
        assert torch.allclose(sliced, whole, atol=1e-6, rtol=0), (sliced - whole).abs().max()
        assert torch.allclose(sliced, twin, atol=1e-5) and float(twin.abs().max()) > 0.05
        assert torch.equal(rounded, sliced.to(torch.bfloat16))


def test_the_slices_are_one_a_16_channels_at_most(sinks_view, monkeypatch):
    """At head_dim 64 eight slices would be 8 channels: the launch takes 4."""
    monkeypatch.setattr(lowbit_combine, "COMBINE_SLICES", 8)
    narrow = attrs.evolve(sinks_view, exact_k=sinks_view.exact_k[..., :64])
    q = torch.randn(1, 8, 64)
    packed = plan_launch(sinks_view, torch.randn(1, 8, 128), None, 0.1, variant="dense")
    assert plan_combine(narrow, q, None, 0.1, packed).constants["SLICES"] == 4


@pytest.mark.parametrize("name, value", [("KVWEAVE_COMBINE_SLICES", "3"), ("KVWEAVE_COMBINE_WARPS", "many"),
                                         ("KVWEAVE_COMBINE_HADAMARD", "3")])
def test_a_wrong_setting_in_the_environment_is_refused_by_name(name, value):
    script = "import kvweave.kernels.lowbit_combine"
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, name: value},
                         capture_output=True, text=True)
    assert run.returncode != 0 and f"environment variable {name}={value!r}: expected one of" in run.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the combine for a CUDA GPU")
@pytest.mark.parametrize("storage", ["k4v2e48t", "k4v4e77t"])
def test_a_combine_in_slices_agrees_with_one_program_a_query_head_on_the_gpu(storage, monkeypatch):
    """32,768 packed tokens, one row (the combine launched early where the GPU can) and eight: each setting of slices
    and warps gives the one-program output to float32 rounding."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    for rows in (1, 8):
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)).cuda()
        whole = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        for slices, warps in ((4, 4), (4, 8), (2, 4), (1, 8)):
            monkeypatch.setattr(lowbit_combine, "COMBINE_SLICES", slices)
            monkeypatch.setattr(lowbit_combine, "COMBINE_WARPS", warps)
            sliced = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
            monkeypatch.undo()
            assert torch.allclose(sliced, whole, rtol=1e-5, atol=1e-6), (slices, warps, (sliced - whole).abs().max())
