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
    monkeypatch.setattr(launch_module, "capability", lambda device: (8, 0))
    assert not launch_module.programmatic(torch.device("cuda", 0))  # an A100: no grid dependency control
    monkeypatch.setattr(launch_module, "capability", lambda device: (9, 0))
    assert launch_module.programmatic(torch.device("cuda", 0))
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_EXACT", False)  # each use has its own switch
    assert launch_module.programmatic(torch.device("cuda", 0), "combine")
    assert not launch_module.programmatic(torch.device("cuda", 0), "exact")
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", False)
    assert not launch_module.programmatic(torch.device("cuda", 0))
    monkeypatch.setattr(launch_module.torch.version, "hip", "6.2")  # a ROCm build: its "cuda" devices are AMD's
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_COMBINE", True)
    assert not launch_module.programmatic(torch.device("cuda", 0))


def test_the_environment_switches_take_on_and_off_and_refuse_anything_else(monkeypatch):
    for value, on in (("0", False), ("off", False), ("False", False), ("1", True), (" yes ", True)):
        monkeypatch.setenv("KVWEAVE_PROGRAMMATIC_EXACT", value)
        assert launch_module.env_switch("KVWEAVE_PROGRAMMATIC_EXACT") is on
    monkeypatch.delenv("KVWEAVE_PROGRAMMATIC_EXACT")
    assert launch_module.env_switch("KVWEAVE_PROGRAMMATIC_EXACT")
    monkeypatch.setenv("KVWEAVE_PROGRAMMATIC_EXACT", "nope")
    with pytest.raises(ValueError, match="KVWEAVE_PROGRAMMATIC_EXACT='nope'"):
        launch_module.env_switch("KVWEAVE_PROGRAMMATIC_EXACT")


def _with_restored(view):
    """``view`` with two tokens a row restored by residuals (what a sinks router keeps), for the combine's merge."""
    import attrs

    batch, heads, _, dim = view.exact_k.shape
    gen = torch.Generator().manual_seed(8)
    return attrs.evolve(view, restored_k=torch.randn(batch, heads, 2, dim, generator=gen),
                        restored_v=torch.randn(batch, heads, 2, dim, generator=gen),
                        restored_pos=torch.tensor([0, 1]).expand(batch, heads, 2).contiguous())


@pytest.mark.skipif(not _nvidia_backend() or not launch_module._triton_has_gdc(),
                    reason="needs Triton's CUDA backend with grid dependency control (Triton 3.4 and later)")
@pytest.mark.parametrize("restored, group_rows", [(False, 256), (True, 256), (True, 0)])
def test_the_combine_waits_for_the_packed_pass_only_where_it_is_launched_early(model, registry, monkeypatch, restored,  # noqa: F811
                                                                              group_rows):
    """Where the device allows it and the dense kernel's programs are one wave, or more at few rows (at most
    ``EARLY_COMBINE_ROWS``), its build holds ``griddepcontrol.launch_dependents`` and the combine's launch asks to start
    early, its build holding ``griddepcontrol.wait`` (before it reads the splits); where they are more (here a GPU
    holding one program at a time) at more rows, or the device does not allow it, neither. Per query head and by KV
    head (``group_rows`` 0), with restored tokens and without."""
    view = _view(model, registry, "t-lowbit-post")
    view = _with_restored(view) if restored else view
    monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", group_rows)
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    for allowed, slots, few, early in ((True, 660, 64, True), (False, 660, 64, False), (True, 1, 0, False),
                                       (True, 1, 64, True)):
        monkeypatch.setattr(lowbit_dense, "programmatic", lambda device, allowed=allowed: allowed)
        monkeypatch.setattr(lowbit_dense, "dense_slots", lambda *args, slots=slots, **kwargs: slots)
        monkeypatch.setattr(lowbit_dense, "EARLY_COMBINE_ROWS", few)
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
@pytest.mark.parametrize("batch, tokens, early", [(1, 32768, True), (1, 131072, True), (8, 32768, True),
                                                  (32, 32768, False)])
def test_on_a_gpu_the_combine_launched_early_gives_the_bits_of_the_combine_after(monkeypatch, batch, tokens, early):
    """The 8x storage (4-bit keys after RoPE, 2-bit values in tiles, 48% kept): at B = 1 the dense kernel's programs are
    one wave and the combine is launched early; at B = 8 they are three, but at 64 rows it is early too; at B = 32
    (256 rows, three waves) it is not. Launched early it is the same
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


class _Recorder:
    """A kernel stand-in that records its launches (name, arguments, constants) in order."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        return lambda *args, **constants: self.launches.append((self.name, args, constants))


def _depthweave_launches(tmp_path, monkeypatch, early: bool) -> list:
    from kvweave.kernels import decode_triton, depthweave_decode, depthweave_tiles_triton

    from test_kernels import DEVICE
    from test_tiles_pass import filled_view

    view = filled_view(tmp_path)  # (on a GPU the flushes launch the tiles pass too)
    launches: list = []
    monkeypatch.setattr(depthweave_decode, "programmatic", lambda device, use: early and use == "exact")
    monkeypatch.setattr(depthweave_tiles_triton, "_tiles_kernel", _Recorder("tiles", launches))
    monkeypatch.setattr(decode_triton, "_exact_split_kernel", _Recorder("exact", launches))
    monkeypatch.setattr(decode_triton, "_combine_kernel", _Recorder("combine", launches))
    monkeypatch.setattr(decode_triton, "_combine_columns_kernel", _Recorder("combine", launches))
    depthweave_decode.fused_decode(view, torch.randn(2, 8, 128, device=DEVICE), None, 0.125, variant="tiles")
    monkeypatch.undo()  # (the caller's patches too, once the call is made)
    return launches


def test_depthweave_s_exact_pass_goes_first_only_where_the_packed_pass_is_launched_early(tmp_path, monkeypatch):
    """With the early launch the exact-window pass is launched first and lets the tiles pass start (``PDL``), which is
    launched as its programmatic dependent; without it, or past ``EARLY_EXACT_ROWS`` batch rows x KV heads, the tiles
    pass goes first, as before; the combine last."""
    early = _depthweave_launches(tmp_path, monkeypatch, True)
    assert [name for name, _, _ in early] == ["exact", "tiles", "combine"]
    assert early[0][2]["PDL"] and early[1][2]["PDL"] and early[1][2]["launch_pdl"]
    after = _depthweave_launches(tmp_path, monkeypatch, False)
    assert [name for name, _, _ in after] == ["tiles", "exact", "combine"]
    assert not after[0][2]["PDL"] and not after[1][2]["PDL"] and "launch_pdl" not in after[0][2]
    from kvweave.kernels import depthweave_decode

    monkeypatch.setattr(depthweave_decode, "EARLY_EXACT_ROWS", 3)  # the case's 2 rows x 2 KV heads are more
    many = _depthweave_launches(tmp_path, monkeypatch, True)
    assert [name for name, _, _ in many] == ["tiles", "exact", "combine"] and not many[0][2]["PDL"]


@pytest.mark.skipif(not _nvidia_backend() or not launch_module._triton_has_gdc(),
                    reason="needs Triton's CUDA backend with grid dependency control (Triton 3.4 and later)")
def test_depthweave_s_passes_build_for_the_gpu_with_their_grid_dependency(tmp_path, monkeypatch):
    """Built for sm_90 as launched early: the exact-window pass holds ``griddepcontrol.launch_dependents``, the tiles
    pass ``griddepcontrol.wait`` (after its stores: it ends only once the exact pass has); as launched after, neither."""
    from kvweave.kernels import decode_triton, depthweave_tiles_triton
    from kvweave.kernels.gpu_build import launch_job

    from test_lowbit_kernel_host import compile_job

    modules = {"exact": (decode_triton, "_exact_split_kernel", "griddepcontrol.launch_dependents"),
               "tiles": (depthweave_tiles_triton, "_tiles_kernel", "griddepcontrol.wait")}
    for early in (True, False):
        for name, args, constants in _depthweave_launches(tmp_path, monkeypatch, early):
            if name in modules:
                module, kernel, instruction = modules[name]
                job = launch_job(getattr(module, kernel), args, constants)
                if name == "tiles":  # the GPU's population counts, as a launch on a GPU passes
                    job["constants"]["ASM"] = True
                assert (instruction in compile_job(job)["ptx_text"]) is early, (name, early)


@pytest.mark.skipif(not _gpu_programmatic(), reason="launches depthweave-kv's passes at once on a CUDA GPU of capability 9 or more")
@pytest.mark.parametrize("batch", [1])
def test_on_a_gpu_depthweave_s_passes_launched_together_give_the_bits_of_the_passes_in_turn(monkeypatch, batch):
    """depthweave-kv's storage of a 32K-token context written by the engine (Llama-3-8B attention shape): the tiles pass
    launched as the exact pass's dependent writes the same partials, so the output is the same bits as with the passes
    in turn, call after call, with two queries in turn (a combine that read a partial before its pass wrote it would
    meet the other query's)."""
    import sys
    from pathlib import Path

    from kvweave.core.registry import load_pipeline
    from kvweave.engine.cache import KVWeaveCache
    from kvweave.engine.synthetic import fill_cache
    from kvweave.kernels.depthweave_decode import fused_decode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from decode_kernel import HEAD_DIM, Q_HEADS, llama3_window_config

    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, batch, 32768, chunk=8192, device="cuda", seed=5)
    view = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
    gen = torch.Generator().manual_seed(6)
    queries = [torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).cuda().bfloat16() for _ in range(2)]
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_EXACT", False)
    in_turn = [fused_decode(view, q, None, HEAD_DIM ** -0.5) for q in queries]
    monkeypatch.setattr(launch_module, "PROGRAMMATIC_EXACT", True)
    for turn in range(20):
        together = fused_decode(view, queries[turn % 2], None, HEAD_DIM ** -0.5)
        assert torch.equal(together, in_turn[turn % 2]), turn
