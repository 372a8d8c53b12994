"""benchmarks/dense_timeline.py's host side: which recorded launches make a cell for each method, the row it prints,
and its plot and program times where the combine takes no trace (depthweave-kv's). The recording itself needs a GPU
(tests/test_timeline.py)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvweave.kernels.timeline import Programs, Recorded

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import dense_timeline  # noqa: E402


def _rows(starts_us, ends_us, sms) -> np.ndarray:
    """A trace [programs, 6] whose cycles are nanoseconds (one cycle a nanosecond), every program ready at its start."""
    start, end = np.asarray(starts_us) * 1000, np.asarray(ends_us) * 1000
    return np.stack([start, end, start, end, np.asarray(sms), start], axis=1).astype(np.int64)


def _programs(starts_us, ends_us) -> Programs:
    start, end = np.asarray(starts_us, float) * 1000, np.asarray(ends_us, float) * 1000
    return Programs(start=start, end=end, ready=start, sm=np.arange(len(start)) % 2, ns_per_cycle=1.0)


@pytest.fixture
def fake_recording(monkeypatch):
    """dense_timeline's ``recording`` replaced by one that a call fills with the launches it is given."""
    launches: list = []

    @contextlib.contextmanager
    def recording():
        calls: list = []
        yield calls
        calls.extend(launches)

    monkeypatch.setattr(dense_timeline, "recording", recording)
    monkeypatch.setattr(dense_timeline.torch.cuda, "synchronize", lambda: None)
    return launches


def test_each_method_takes_its_own_kernels_launches(fake_recording):
    packed = Recorded("_lowbit_dense_kernel", (2, 1), _rows([0, 1], [5, 6], [0, 1]))
    combine = Recorded("_lowbit_combine_group_kernel", (2,), _rows([6, 6], [7, 8], [0, 1]))
    tiles = Recorded("_tiles_kernel", (3,), _rows([0, 0, 2], [4, 3, 9], [0, 1, 0]))
    fake_recording[:] = [packed, combine]
    found, after = dense_timeline.traced_call(lambda: None)
    assert found.end.max() == 6000 and after.end.max() == 8000
    fake_recording[:] = [tiles]
    found, after = dense_timeline.traced_call(lambda: None, "depthweave-kv")
    assert len(found.start) == 3 and after is None
    with pytest.raises(RuntimeError, match="dense's packed pass and its combine traced once"):
        dense_timeline.traced_call(lambda: None)  # the tiles pass alone is not the dense kernel's call
    fake_recording[:] = [tiles, tiles]
    with pytest.raises(RuntimeError, match="depthweave-kv's packed pass traced once"):
        dense_timeline.traced_call(lambda: None, "depthweave-kv")


def test_a_cell_without_a_traced_combine_prints_plots_and_keeps_its_programs(capsys, tmp_path):
    records = [(_programs([0, 0, 5], [10, 5, 9]), None), (_programs([0, 0, 4], [12, 6, 11]), None),
               (_programs([0, 0, 3], [8, 3, 8]), None)]
    cell = dense_timeline.reported(32768, 8, "depthweave-kv tiles", 2, records, 20.0)
    row = capsys.readouterr().out
    assert "not traced" in row and cell["span"] == 10.0 and "combine" not in cell  # the median span of 8, 10, 12
    assert dense_timeline.program_times(cell) == {"packed": {"start": [0.0, 0.0, 5.0], "end": [10.0, 5.0, 9.0],
                                                             "sm": [0, 1, 0]}}
    pytest.importorskip("matplotlib")
    dense_timeline.plot([cell], tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 1000


def test_sm_loads_group_the_sms_by_programs_run(tmp_path, capsys):
    """Three SMs: two ran two programs, one ran one; each group's lengths and last end, from arrays and from a run's
    JSON as ``--sm-loads`` reads it."""
    from kvweave.kernels.timeline import sm_loads

    start, end, sm = [0, 0, 0, 5, 6], [5, 4, 9, 12, 10], [0, 1, 2, 0, 1]
    loads = sm_loads(start, end, sm)
    assert [(g["programs"], g["sms"], g["last_end"]) for g in loads] == [(1, 1, 9.0), (2, 2, 12.0)]
    assert loads[1]["median"] == 4.5  # lengths 5, 4, 7, 4
    path = tmp_path / "dense_timeline.json"
    path.write_text(json.dumps({"rows": [{"tokens": 64, "batch": 1, "kernel": "k", "program_times": {
        "packed": {"start": start, "end": end, "sm": sm}}}]}))
    dense_timeline.print_sm_loads(path)
    assert "| 64 | 1 | k | 2 | 2 | 4.5 / " in capsys.readouterr().out
