"""benchmarks/read_floor.py's read kernels under Triton's interpreter: every word of the storage is read exactly once
(so the floor they time is the storage's bytes), and the fold sums each row's share of the partials."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import read_floor  # noqa: E402


def wrapped(total: int) -> int:
    """``total`` as a wrapping int32 sum."""
    return (total + 2**31) % 2**32 - 2**31


@pytest.mark.parametrize("words,programs", [(1, 1), (5000, 3), (4096, 4), (3 * 1024 + 17, 7)])
def test_each_word_is_read_once_whatever_the_programs(words, programs):
    src = torch.randint(-2**31, 2**31 - 1, (words,), dtype=torch.int32, generator=torch.Generator().manual_seed(words))
    partial = read_floor.read_words(src, programs)
    assert partial.shape == (programs,)
    assert wrapped(int(partial.long().sum())) == wrapped(int(src.long().sum()))
    # each program sums its own chunk: a word moved from one chunk to another changes two partials
    chunk = read_floor.read_chunk(words, programs)
    for p in range(programs):
        assert int(partial[p]) == wrapped(int(src[p * chunk:(p + 1) * chunk].long().sum()))


def test_the_fold_sums_each_rows_share_of_the_partials():
    partial = torch.arange(1, 11, dtype=torch.int32)
    assert read_floor.fold(partial, 3).tolist() == [1 + 2 + 3 + 4, 5 + 6 + 7 + 8, 9 + 10]
    assert read_floor.fold(partial, 1).tolist() == [55]


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="flat contiguous int32"):
        read_floor.read_words(torch.zeros(4, dtype=torch.int64), 1)
    with pytest.raises(ValueError, match="at least one program"):
        read_floor.read_words(torch.zeros(4, dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="at least one row"):
        read_floor.fold(torch.zeros(4, dtype=torch.int32), 0)


def test_copies_are_read_in_turn_and_hold_the_same_storage():
    import decode_kernel
    import lowbit_kernel

    pick = decode_kernel.in_turn(["a", "b", "c"])
    assert [pick() for _ in range(7)] == ["a", "b", "c", "a", "b", "c", "a"]
    assert decode_kernel.cold_copies(1 << 20, cold=False) == 1
    view = lowbit_kernel.packed_view(1, 256, device="cpu", storage="k4v2e48t")
    copies = decode_kernel.tensor_copies(view, 3)
    assert len(copies) == 3 and copies[0] is view
    for other in copies[1:]:
        assert other.k_codes.data_ptr() != view.k_codes.data_ptr() and other.v_codes.data_ptr() != view.v_codes.data_ptr()
        assert torch.equal(other.k_codes, view.k_codes) and torch.equal(other.v_scale, view.v_scale)
        assert other.tokens == view.tokens and lowbit_kernel.view_bytes(other) == lowbit_kernel.view_bytes(view)
    keys = torch.randn(2, 3)
    (k2, v2), = decode_kernel.tensor_copies((keys, keys * 2), 2)[1:]
    assert torch.equal(k2, keys) and torch.equal(v2, keys * 2) and k2.data_ptr() != keys.data_ptr()


def test_a_depthweave_view_is_copied_down_to_its_residual_levels(tmp_path):
    import decode_kernel
    from test_kernels import decode_view, filled

    view = decode_view(filled(tmp_path, 4, 2, 64, 200), 1)
    assert view.k_levels and view.k_levels[0].packed.numel()
    copy = decode_kernel.tensor_copies(view, 2)[1]
    assert copy.k_codes.data_ptr() != view.k_codes.data_ptr() and torch.equal(copy.k_codes, view.k_codes)
    for mine, theirs in zip(copy.k_levels, view.k_levels):
        assert mine.packed.data_ptr() != theirs.packed.data_ptr() and torch.equal(mine.packed, theirs.packed)
    assert decode_kernel.view_bytes(copy) == decode_kernel.view_bytes(view)


def test_the_plot_of_an_earlier_run_needs_no_gpu(tmp_path, monkeypatch, capsys):
    rows = [{"tokens": 32768, "batch": b, "storage": "k4v2e48t", "bytes_read": 14e6 * b, "sdpa_us": 50.0 * b,
             "read_us": 4.0 * b, "read_fold_us": 5.0 * b, "kernel_us": 10.0 * b, "bar": 6.78} for b in (1, 8)]
    rows.append({**rows[0], "storage": "8.25x smaller", "kernel_us": None})
    record = {"device": "a GPU", "date": "2026-12-07", "l2_bytes": 50 * 2**20, "rows": rows}
    path = tmp_path / "read_floor.json"
    path.write_text(__import__("json").dumps(record))
    monkeypatch.setattr(sys, "argv", ["read_floor.py", "--plot", str(path)])
    read_floor.main()
    assert (tmp_path / "read_floor.png").stat().st_size > 10_000
    monkeypatch.setattr(sys, "argv", ["read_floor.py", "--plot", str(tmp_path / "missing.json")])
    with pytest.raises(SystemExit, match="no file"):
        read_floor.main()
