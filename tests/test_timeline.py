"""Kernel timelines (``kvweave.kernels.timeline``): the traces' alignment onto one clock and their summary on made-up
traces whose answer is known; the recording's refusals; the launches passing a placeholder and ``TRACE`` = 0 outside a
recording, so the production build reads no timer, and the traced build reading them (compiled for sm_90 on this CPU);
on a GPU, a recorded call gives the bits of an unrecorded one and every program writes its row."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvweave.kernels import launch as launch_module
from kvweave.kernels import timeline
from kvweave.kernels.lowbit_decode import plan_combine, plan_launch

from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model
from test_lowbit_kernel_host import _nvidia_backend, compile_for_gpu
from test_programmatic_launch import _view


def _trace(starts_ns, ends_ns, sms, offsets_cycles, ns_per_cycle=0.5, timer_step=1000, ready_ns=None):
    """A made-up trace: programs at true times ``starts_ns`` .. ``ends_ns`` on SMs ``sms``, each SM's cycle counter
    ``offsets_cycles[sm]`` off, the global timer read in steps of ``timer_step`` ns."""
    starts, ends = np.asarray(starts_ns, float), np.asarray(ends_ns, float)
    sm = np.asarray(sms)
    off = np.asarray(offsets_cycles, float)[sm]
    ready = starts if ready_ns is None else np.asarray(ready_ns, float)
    rows = np.stack([starts // timer_step * timer_step, ends // timer_step * timer_step, starts / ns_per_cycle + off,
                     ends / ns_per_cycle + off, sm, ready / ns_per_cycle + off], axis=1)
    return rows.astype(np.int64)


def test_programs_are_put_on_one_clock_from_each_sms_cycles():
    """Each SM's cycle counter has its own origin; the timer steps by a microsecond. The programs' times come back to
    within the timer's step, and lengths within 0.5%; without an offset per SM they would be millions of ns off."""
    rng = np.random.default_rng(0)
    starts = rng.uniform(1e6, 1.05e6, 40)
    ends = starts + rng.uniform(3e3, 20e3, 40)
    sms = np.arange(40) % 4
    progs = timeline.programs(_trace(starts, ends, sms, [0, 7e6, 3e9, 11]))
    assert progs.ns_per_cycle == pytest.approx(0.5, rel=5e-3)
    assert np.abs(progs.start - starts).max() < 1000
    assert np.allclose(progs.end - progs.start, ends - starts, rtol=5e-3)
    assert np.array_equal(progs.sm, sms)


def test_the_summary_finds_the_waves_the_ramp_and_a_straggler():
    """4 slots, 9 programs: two waves of 10 us and one program that starts as the second ends and runs 6 us alone."""
    starts = [0, 0, 0, 0, 10e3, 10e3, 10e3, 10e3, 20e3]
    ends = [10e3, 10e3, 10e3, 10e3, 20e3, 20e3, 20e3, 20e3, 26e3]
    offsets = 1e6 + np.arange(4) * 1e5
    sms = [0, 1, 2, 3, 0, 1, 2, 3, 2]
    packed = timeline.programs(_trace(np.add(starts, 5e6), np.add(ends, 5e6), sms, offsets, timer_step=1))
    combine = timeline.programs(_trace(np.array([15e3, 15e3]) + 5e6, np.array([27e3, 27.5e3]) + 5e6, [0, 1], offsets,
                                       timer_step=1, ready_ns=np.array([26e3, 26.2e3]) + 5e6))
    found = timeline.summary(packed, 4, combine)
    assert found["span"] == pytest.approx(26.0, abs=0.01)
    assert found["tail"] == pytest.approx(6.0, abs=0.01)  # from the second wave's end to the straggler's
    assert found["ramp"] == pytest.approx(0.0, abs=0.01)
    assert found["busy_share"] == pytest.approx(86 / (4 * 26), abs=1e-3)
    assert found["waves"] == pytest.approx([10.0, 10.0, 6.0], abs=0.01)
    assert found["last_start"] == pytest.approx(20.0, abs=0.01)
    assert found["combine"]["ready_first"] == pytest.approx(26.0, abs=0.01)
    assert found["combine"]["after"] == pytest.approx(1.5, abs=0.01)
    assert list(timeline.busy(packed, np.array([5e6 + 5e3, 5e6 + 15e3, 5e6 + 22e3]))) == [4, 4, 1]


def test_a_trace_with_a_program_that_wrote_nothing_or_the_wrong_shape_is_refused():
    rows = _trace([0, 5e3], [4e3, 9e3], [0, 1], [0, 0])
    rows[1] = 0
    with pytest.raises(ValueError, match="1 of 2 programs wrote no stamp"):
        timeline.programs(rows)
    with pytest.raises(ValueError, match=r"\[programs, 6\]"):
        timeline.programs(np.zeros((3, 4), dtype=np.int64))


def test_a_recording_is_refused_under_the_interpreter_and_when_nested(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="interpreter"):
        with timeline.recording():
            pass
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with timeline.recording() as calls:
        assert timeline.active() and calls == []
        with pytest.raises(RuntimeError, match="do not nest"):
            with timeline.recording():
                pass
    assert not timeline.active()


def test_outside_a_recording_the_launches_pass_a_placeholder_and_inside_a_trace(model, registry, monkeypatch):  # noqa: F811
    """The dense pass and both combines name their trace argument and take ``TRACE`` = 0; a recording swaps in a
    [programs, 6] int64 buffer and 1, and records the launch (run here with a stand-in kernel)."""
    view = _view(model, registry, "t-lowbit-post")
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    packed = plan_launch(view, q, None, 0.125, variant="dense", programs=None)
    launches = [packed, plan_combine(view, q, None, 0.125, packed)]
    from kvweave.kernels import lowbit_combine

    monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", 0)
    launches.append(plan_combine(view, q, None, 0.125, packed))
    assert launches[2].kernel is not launches[1].kernel
    for launch in launches:
        assert launch.constants["TRACE"] == 0 and launch.trace_at == len(launch.args) - 1
        assert isinstance(launch.args[launch.trace_at], torch.Tensor)
    seen = []

    def stand_in():  # the kernel's function, by name
        pass

    class Kernel:  # stands in for the Triton kernel: what the launch passes
        fn = stand_in

        def __getitem__(self, grid):
            return lambda *args, **constants: seen.append((grid, args, constants))

    stand_in = launch_module.Launch(Kernel(), packed.grid, packed.args, packed.constants, packed.outputs, packed.trace_at)
    stand_in.run()
    assert seen[-1][2]["TRACE"] == 0 and seen[-1][1][-1] is packed.args[-1]
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with timeline.recording() as calls:
        stand_in.run()
    grid, args, constants = seen[-1]
    assert constants["TRACE"] == 1 and args[:-1] == packed.args[:-1]
    assert args[-1].shape == (packed.grid[0] * packed.grid[1], 6) and args[-1].dtype == torch.int64
    assert len(calls) == 1 and calls[0].trace is args[-1] and calls[0].name == "stand_in"


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
def test_only_the_traced_build_reads_the_timers(model, registry):  # noqa: F811
    import attrs

    view = _view(model, registry, "t-lowbit-post")
    q = torch.randn(view.exact_k.shape[0], 4, view.exact_k.shape[-1])
    packed = plan_launch(view, q, None, 0.125, variant="dense", programs=None, lowp=True)
    combine = plan_combine(view, q, None, 0.125, packed)
    for launch in (combine, packed):
        traced = attrs.evolve(launch, constants={**launch.constants, "TRACE": 1})
        for build, on in ((launch, False), (traced, True)):
            ptx = compile_for_gpu(build)["ptx_text"]
            assert all((reg in ptx) is on for reg in ("%globaltimer", "%clock64", "%smid"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="reads a GPU's timers")
@pytest.mark.parametrize("batch", [1, 8])
def test_on_a_gpu_a_recorded_call_gives_the_same_bits_and_every_program_a_row(batch):
    import sys
    from pathlib import Path

    import attrs

    from kvweave.kernels.lowbit_decode import lowbit_decode

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    view = attrs.evolve(packed_view(batch, 32768, device="cuda", storage="k4v2e48t"), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).cuda().bfloat16()

    def call():
        return lowbit_decode(view, q, None, HEAD_DIM ** -0.5, programs=None, out_dtype=torch.bfloat16)

    plain = call()
    with timeline.recording() as calls:
        traced = call()
    torch.cuda.synchronize()
    assert torch.equal(plain, traced)
    assert [c.name for c in calls] == ["_lowbit_dense_kernel", "_lowbit_combine_kernel"]
    packed, combine = (timeline.programs(c.trace) for c in calls)
    assert (packed.end > packed.start).all() and (combine.ready >= combine.start).all()
    assert combine.end.max() > packed.end.max()  # the combine ends after the pass it merges
    assert (packed.end.max() - packed.start.min()) < 5e6  # one call: well under 5 ms


def test_depthweave_s_tiles_pass_passes_a_placeholder_and_in_a_recording_a_trace(tmp_path, monkeypatch):
    """``fused_decode``'s tiles pass (launched outside :class:`Launch`) takes ``TRACE`` = 0 and a placeholder for its
    last argument, and inside a recording a [programs, 6] buffer (recorded) and 1 (the kernel recorded, not run)."""
    from test_kernels import DEVICE
    from test_tiles_pass import filled_view, recorded_tiles_launches

    from kvweave.kernels.depthweave_decode import fused_decode

    view = filled_view(tmp_path)
    query = torch.randn(2, 8, 128, device=DEVICE)

    def call():
        return fused_decode(view, query, None, 0.125, variant="tiles")

    (args, constants), = recorded_tiles_launches(call)
    assert constants["TRACE"] == 0 and args[-1].dtype != torch.int64
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with timeline.recording() as calls:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the other passes still run in the interpreter
        (args, constants), = recorded_tiles_launches(call)
    assert constants["TRACE"] == 1 and args[-1].dtype == torch.int64 and args[-1].shape[1] == 6
    assert len(calls) == 1 and calls[0].trace is args[-1] and args[-1].shape[0] == int(np.prod(calls[0].grid))
