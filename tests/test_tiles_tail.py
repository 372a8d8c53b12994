"""depthweave-kv's tiles pass with a shorter last wave (:mod:`kvweave.kernels.tiles_tail`, ``KVWEAVE_TILES_TAIL``): the
segments it cuts (every token once, none across a version, each row's last wave's worth shorter where the programs are
more than one wave), and the pass launched segment-major over them giving the output of the pass as launched by
default, under Triton's interpreter."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.kernels import depthweave_decode, depthweave_tiles_triton, tiles_tail
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.decode_view import TILE, version_segments

from env_settings import check_env_setting
from test_kernels import DEVICE, decode_view, filled


def _covers(segments: torch.Tensor, version_tokens: list[int]) -> None:
    """Every token once, in order; each segment inside one version, starting on a tile."""
    rows = segments.tolist()
    assert rows[0][0] == 0 and rows[-1][1] == sum(version_tokens)
    assert all(a[1] == b[0] for a, b in zip(rows, rows[1:])) and all(lo < hi and lo % TILE == 0 for lo, hi, _ in rows)
    starts = [sum(version_tokens[:v]) for v in range(len(version_tokens))]
    for lo, hi, v in rows:
        assert starts[v] <= lo and hi <= starts[v] + version_tokens[v], (lo, hi, v)


@pytest.mark.parametrize("versions", [[32768], [4096, 2048, 26624]])
def test_each_rows_last_wave_of_segments_is_shorter_where_the_programs_are_more_than_a_wave(versions):
    rows, slots, split = 256, 1584, 2048  # B = 32 at Llama-3-8B's 8 KV heads, 12 programs an SM on 132 SMs
    uniform = version_segments(versions, split, "cpu")
    assert rows * uniform.shape[0] > slots
    tail = tiles_tail.tail_segments(versions, split, rows, slots, "cpu", percent=33)
    _covers(tail, versions)
    lengths = (tail[:, 1] - tail[:, 0]).tolist()
    short = -(-slots // rows)  # a wave's worth of segments a row: the last ones launched segment-major
    assert max(lengths[-short:]) <= split * 33 // 100 < min(lengths[:-short][:1])
    assert abs(len(lengths) - uniform.shape[0]) <= len(versions)  # about as many programs as before
    for percent in (0, 100):  # off, and segment-major with every segment alike
        assert torch.equal(tiles_tail.tail_segments(versions, split, rows, slots, "cpu", percent=percent), uniform)
    one_wave = tiles_tail.tail_segments(versions, split, 8, slots, "cpu", percent=33)  # 8 rows: one wave
    assert torch.equal(one_wave, uniform)


@pytest.mark.interpreter
def test_the_pass_launched_segment_major_over_a_tail_gives_the_default_launchs_output(tmp_path, monkeypatch):
    """A 320-token layer (two basis versions, residual levels) cut for 2 slots so that its last segment is short, the
    pass launched segment-major (grid (B x H, S)): the same bits as the default launch over those segments, and the
    torch twin's output."""
    view = decode_view(filled(tmp_path, 8, 2, 128, 320), 1)
    q = torch.randn(2, 8, 128, device=DEVICE, generator=torch.Generator().manual_seed(3))
    tail = tiles_tail.resplit_rows(view.segments, 64, rows=4, slots=2, percent=50)
    assert tail.shape[0] >= 3 and (tail[-1, 1] - tail[-1, 0]).item() == TILE  # the last ones a tile long
    grids = []
    kernel = depthweave_tiles_triton._tiles_kernel

    class Recorded:  # the real kernel, its grid noted
        def __getitem__(self, grid):
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(depthweave_tiles_triton, "_tiles_kernel", Recorded())
    monkeypatch.setattr(tiles_tail, "TILES_TAIL", 50)
    out = depthweave_decode.fused_decode(attrs.evolve(view, segments=tail), q, None, 0.125, variant="tiles")
    assert grids == [(4, tail.shape[0])]  # rows x KV heads first: segment-major
    monkeypatch.setattr(tiles_tail, "TILES_TAIL", 0)
    in_order = depthweave_decode.fused_decode(attrs.evolve(view, segments=tail), q, None, 0.125, variant="tiles")
    assert grids[-1] == (tail.shape[0], 4) and torch.equal(out, in_order)  # the same programs, launched in another order
    twin = torch_decode(view, q, None, 0.125).float()
    assert torch.allclose(out.float(), twin, atol=2e-3)


def test_the_setting_is_read_from_the_environment_and_a_wrong_value_refused():
    check_env_setting("KVWEAVE_TILES_TAIL",
                      "from kvweave.kernels import tiles_tail; print(tiles_tail.TILES_TAIL, tiles_tail.seg_major())",
                      {"0": "0 False", "33": "33 True", "100": "100 True"}, "40")
