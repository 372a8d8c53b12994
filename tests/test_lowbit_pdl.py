"""The lowbit combine launched as a programmatic dependent of the packed pass (``kvweave.kernels.launch.programmatic``):
where the device allows it, the combine's launch asks for it and its programs wait for the packed pass before they read
the splits, and the dense kernel lets it start; elsewhere neither kernel holds the grid dependency instructions
(compiled for sm_90 on this CPU; the GPU tests of test_lowbit_gpu.py run both on a GPU)."""

from __future__ import annotations

import pytest
import torch

from kvweave.engine import build_cache, importance
from kvweave.kernels import launch as launch_module
from kvweave.kernels import lowbit_combine, lowbit_dense
from kvweave.kernels.lowbit_decode import plan_combine, plan_launch

from conftest import CharTokenizer
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model
from test_lowbit_kernel_host import _nvidia_backend, compile_for_gpu


def _view(model, registry, name):  # noqa: F811 - the fixtures
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4))
    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, ids)
    return cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))


def test_only_a_cuda_device_of_capability_9_launches_the_combine_early(monkeypatch):
    assert not launch_module.programmatic(torch.device("cpu"))
    monkeypatch.setattr(launch_module, "_triton_has_gdc", lambda: True)
    monkeypatch.setattr(launch_module, "_capability", lambda index: (8, 0))
    assert not launch_module.programmatic(torch.device("cuda", 0))  # an A100: no grid dependency control
    monkeypatch.setattr(launch_module, "_capability", lambda index: (9, 0))
    assert launch_module.programmatic(torch.device("cuda", 0))
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", False)
    assert not launch_module.programmatic(torch.device("cuda", 0))


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("name, group_rows", [("t-lowbit-post", 256), ("t-lowbit-sinks", 256), ("t-lowbit-sinks", 0)])
def test_the_combine_waits_for_the_packed_pass_only_where_it_is_launched_early(model, registry, monkeypatch, name,  # noqa: F811
                                                                              group_rows):
    """With the early launch the combine's build holds ``griddepcontrol.wait`` (before it reads the splits) and asks
    for the launch; the dense kernel's holds ``griddepcontrol.launch_dependents``; without it, neither. Per query head
    and by KV head (``group_rows`` 0), with tokens restored by residuals (sinks) and without."""
    view = _view(model, registry, name)
    monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", group_rows)
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    for early in (True, False):
        monkeypatch.setattr(lowbit_combine, "programmatic", lambda device: early)
        monkeypatch.setattr(lowbit_dense, "programmatic", lambda device: early)
        packed = plan_launch(view, q, None, 0.125, variant="auto", lowp=True)
        combine = plan_combine(view, q, None, 0.125, packed, torch.bfloat16)
        assert combine.constants["PDL"] is early and combine.constants.get("launch_pdl", False) is early
        waits = compile_for_gpu(combine)["ptx_text"]
        assert ("griddepcontrol.wait" in waits) is early
        if packed.kernel.fn.__name__ == "_lowbit_dense_kernel":
            lets = compile_for_gpu(packed)["ptx_text"]
            assert ("griddepcontrol.launch_dependents" in lets) is early
        else:  # the other variants end before the combine starts (the dependency's implicit trigger)
            assert name != "t-lowbit-post"


def _gpu_programmatic() -> bool:
    return torch.cuda.is_available() and launch_module.programmatic(torch.device("cuda"))


@pytest.mark.skipif(not _gpu_programmatic(), reason="launches the combine early on a CUDA GPU of capability 9 or more")
@pytest.mark.parametrize("batch", [1, 8])
def test_on_a_gpu_the_combine_launched_early_gives_the_bits_of_the_combine_after(monkeypatch, batch):
    """The 8x storage (4-bit keys after RoPE, 2-bit values in tiles, 48% kept) at 32,768 tokens: the combine launched
    early is the same arithmetic as the one launched after the packed pass, so its output is the same bits, call after
    call, with two queries in turn (a combine that read the splits before the pass wrote them would meet the other
    query's splits)."""
    import sys
    from pathlib import Path

    import attrs

    from kvweave.kernels.lowbit_decode import lowbit_decode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    view = attrs.evolve(packed_view(batch, 32768, device="cuda", storage="k4v2e48t"), inv_freq=None)
    gen = torch.Generator().manual_seed(3)
    queries = [torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).cuda().bfloat16() for _ in range(2)]

    def call(q):
        return lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="auto", programs=None, out_dtype=torch.bfloat16)

    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", False)
    after = [call(q) for q in queries]
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", True)
    assert plan_launch(view, queries[0], None, HEAD_DIM ** -0.5, variant="auto", programs=None).constants["PDL"]
    for turn in range(20):
        early = call(queries[turn % 2])
        assert torch.equal(early, after[turn % 2]), (turn, float((early.float() - after[turn % 2].float()).abs().max()))
