"""The lowbit combine launched as a programmatic dependent of the packed pass (``kvweave.kernels.launch.programmatic``):
where the device allows it and the dense kernel's programs fit in one wave, the combine's launch asks for it and its
programs wait for the packed pass before they read the splits, and the dense kernel lets it start; elsewhere neither kernel holds the grid dependency instructions
(compiled for sm_90 on this CPU; on a GPU the output is the same bits either way)."""

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


def _with_restored(view):
    """``view`` with two tokens a row restored by residuals (what a sinks router keeps), for the combine's merge."""
    import attrs

    batch, heads, _, dim = view.exact_k.shape
    gen = torch.Generator().manual_seed(8)
    return attrs.evolve(view, restored_k=torch.randn(batch, heads, 2, dim, generator=gen),
                        restored_v=torch.randn(batch, heads, 2, dim, generator=gen),
                        restored_pos=torch.tensor([0, 1]).expand(batch, heads, 2).contiguous())


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("restored, group_rows", [(False, 256), (True, 256), (True, 0)])
def test_the_combine_waits_for_the_packed_pass_only_where_it_is_launched_early(model, registry, monkeypatch, restored,  # noqa: F811
                                                                              group_rows):
    """Where the device allows it and the dense kernel's programs are one wave, its build holds
    ``griddepcontrol.launch_dependents`` and the combine's launch asks to start early, its build holding
    ``griddepcontrol.wait`` (before it reads the splits); where they are more (here a GPU holding one program at a
    time) or the device does not allow it, neither. Per query head and by KV head (``group_rows`` 0), with restored tokens and without."""
    view = _view(model, registry, "t-lowbit-post")
    view = _with_restored(view) if restored else view
    monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", group_rows)
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    for allowed, slots, early in ((True, 660, True), (False, 660, False), (True, 1, False)):
        monkeypatch.setattr(lowbit_dense, "programmatic", lambda device: allowed)
        monkeypatch.setattr(lowbit_dense, "dense_slots", lambda *args, **kwargs: slots)
        packed = plan_launch(view, q, None, 0.125, variant="dense", programs=None, lowp=True)
        assert 1 < packed.grid[0] * packed.grid[1] <= 660
        combine = plan_combine(view, q, None, 0.125, packed, torch.bfloat16)
        assert packed.constants["PDL"] is early and combine.constants["PDL"] is early
        assert combine.constants.get("launch_pdl", False) is early
        assert ("griddepcontrol.wait" in compile_for_gpu(combine)["ptx_text"]) is early
        if group_rows:  # the packed pass's build is the same for both combines
            assert ("griddepcontrol.launch_dependents" in compile_for_gpu(packed)["ptx_text"]) is early


def test_the_other_kernels_combine_after_the_packed_pass(model, registry):  # noqa: F811
    view = _view(model, registry, "t-lowbit-kvzip")
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    packed = plan_launch(view, q, None, 0.125, variant="wide", programs=None)
    assert not plan_combine(view, q, None, 0.125, packed).constants["PDL"]


def _gpu_programmatic() -> bool:
    return torch.cuda.is_available() and launch_module.programmatic(torch.device("cuda"))


@pytest.mark.skipif(not _gpu_programmatic(), reason="launches the combine early on a CUDA GPU of capability 9 or more")
@pytest.mark.parametrize("batch, tokens, early", [(1, 32768, True), (1, 131072, True), (8, 32768, False)])
def test_on_a_gpu_the_combine_launched_early_gives_the_bits_of_the_combine_after(monkeypatch, batch, tokens, early):
    """The 8x storage (4-bit keys after RoPE, 2-bit values in tiles, 48% kept): at B = 1 the dense kernel's programs are
    one wave and the combine is launched early, at B = 8 they are three and it is not. Launched early it is the same
    arithmetic, so its output is the same bits, call after call, with two queries in turn (a combine that read the
    splits before the pass wrote them would meet the other query's splits)."""
    import sys
    from pathlib import Path

    import attrs

    from kvweave.kernels.lowbit_decode import lowbit_decode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    view = attrs.evolve(packed_view(batch, tokens, device="cuda", storage="k4v2e48t"), inv_freq=None)
    gen = torch.Generator().manual_seed(3)
    queries = [torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).cuda().bfloat16() for _ in range(2)]

    def call(q):
        return lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="auto", programs=None, out_dtype=torch.bfloat16)

    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", False)
    after = [call(q) for q in queries]
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", True)
    assert plan_launch(view, queries[0], None, HEAD_DIM ** -0.5, variant="auto", programs=None).constants["PDL"] is early
    for turn in range(20):
        early = call(queries[turn % 2])
        assert torch.equal(early, after[turn % 2]), (turn, float((early.float() - after[turn % 2].float()).abs().max()))
