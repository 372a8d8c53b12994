"""Keys in token groups longer than the dense kernel's step (``KGROUP`` > ``BLOCK``, each step folding its group's
scales into the query): the torch twin's output under Triton's interpreter, splits that begin inside a group
included; the sm_90 build of that storage (``benchmarks/lowbit_kernel.py``'s ``k4g128v2e48t``) against 64-token
groups'; and the pipeline that stores it (``kzd-k4g128v2-f48``) decoded through the kernel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.kernels.gpu_build import nvdisasm
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

from test_lowbit_kernel import model  # noqa: F401 - the tests' model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.interpreter
@pytest.mark.parametrize("programs", [8, 64])  # one split a row; eight of one 64-token step (half begin inside a group)
def test_keys_in_groups_of_two_steps_give_the_twins_output(programs):
    import lowbit_kernel

    view = lowbit_kernel.packed_view(1, 1072, device="cpu", storage="k4g128v2e48t")  # 48%: 514 -> 512 slots
    view = attrs.evolve(view, inv_freq=None)  # keys after RoPE; 512 slots: four groups of 128
    assert view.k_group == 128 and view.k_scale.shape[-2] == 4
    q = torch.randn(1, lowbit_kernel.Q_HEADS, lowbit_kernel.HEAD_DIM, generator=torch.Generator().manual_seed(5))
    scaling = lowbit_kernel.HEAD_DIM ** -0.5
    launch = plan_launch(view, q, None, scaling, variant="dense", programs=programs)
    assert (launch.constants["KGROUP"], launch.constants["BLOCK"]) == (128, 64) and launch.constants["KPLANES"]
    out = lowbit_decode(view, q, None, scaling, variant="dense", programs=programs)
    twin = torch_lowbit_decode(view, q, None, scaling)
    assert torch.allclose(out, twin, atol=1e-5), (out - twin).abs().max()
    # a group's fold applied to the wrong group's tokens moves the output by far more than that
    wrong = attrs.evolve(view, k_scale=view.k_scale.roll(1, dims=-2), k_zero=view.k_zero.roll(1, dims=-2))
    assert (torch_lowbit_decode(wrong, q, None, scaling) - twin).abs().max() > 1e-2


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_the_sm90_build_of_keys_in_groups_of_128_is_the_loop_of_groups_of_64(tmp_path):
    """benchmarks/kernel_sass.py builds the storage with keys' statistics over 128 tokens (``k4g128v2e48t``) for sm_90:
    with the fold every step its token loop is as long as the 64-token groups' storage's (the group's index a shift
    of another width)."""
    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "sass.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "kernel_sass.py"), "--storages",
                           "k4g128v2e48t-post,k4v2e48t-post", "--configs", "dense:", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {row["storage"]: row for row in json.loads(out.read_text())}
    assert rows["k4g128v2e48t-post"]["loop"] == rows["k4v2e48t-post"]["loop"] > 0


@pytest.mark.interpreter
def test_the_pipeline_with_keys_in_groups_of_128_decodes_through_the_dense_kernel(model):
    """benchmarks/dense_sweep.toml's ``kzd-k4g128v2-f48`` (the 8x pipeline with its keys' statistics over 128 tokens,
    blocks of 128) stores keys the default launch gives the dense kernel, in groups of 128, and decodes as the twin."""
    from kvweave.core.registry import load_registry
    from kvweave.engine import build_cache, importance
    from kvweave.kernels.lowbit_decode import resolve_variant

    from conftest import CharTokenizer

    registry = load_registry(Path(__file__).resolve().parents[1] / "benchmarks" / "dense_sweep.toml")
    cache = build_cache(registry.resolve("kzd-k4g128v2-f48"), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4)))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.inv_freq is None and view.positions is not None and view.restored_k is not None
    assert view.k_group == 128 and view.tokens % 128 == 0 and view.tokens > 0
    assert resolve_variant(view, "auto") == ("dense", 32)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(lowbit_decode(view, q, None, 0.125), torch_lowbit_decode(view, q, None, 0.125), atol=1e-5)
