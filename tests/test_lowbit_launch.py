"""How the ``lowbit`` kernel's launches are shaped where the caller leaves it to them: the dense kernel's register cap
(5 programs an SM, 4 with a hidden-slot list), its splits by waves of programs and its query rows (read in place,
padded to the tile), and the combine's grouping (a program per query head, or per KV head past ``COMBINE_GROUP_ROWS``
rows; its splits in one tile or in loops), each against the torch twin under Triton's interpreter."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

from conftest import tiny_llama
from test_lowbit_dense import _post_rope_view
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


def test_the_launch_splits_the_dense_rows_into_waves_of_the_programs_an_sm_holds(monkeypatch):
    """Where the caller names no number of programs, the dense kernel's rows split into about ``DENSE_WAVES`` waves of
    the programs the SMs hold at once (5 an SM at 96 registers, 4 at 128 with a hidden-slot list), at least
    ``DENSE_MIN_SPLITS`` and at most ``DENSE_MAX_SPLITS`` a row, never fewer than ``DENSE_SPLIT_STEPS`` steps a split;
    with ``DENSE_WHOLE_WAVES``, where the fewest splits decide, up to half as many more whose last wave is fullest
    (never modelled slower than the fewest)."""
    from kvweave.kernels import lowbit_dense as ld

    assert ld.dense_registers(128, False) == 96 and ld.dense_registers(128, True) == 128
    assert ld.dense_registers(256, False) == ld.dense_registers(256, True) == ld.DENSE_WIDE_REGISTERS == 128
    sms = 132

    def modelled(rows, steps, splits, slots):
        return -(-rows * splits // slots) * (steps / splits + ld.DENSE_PROGRAM_STEPS)

    for whole in (False, True):
        monkeypatch.setattr(ld, "DENSE_WHOLE_WAVES", whole)
        for rows in (8, 64, 256, 1024, 4096):
            for steps in (5, 246, 492, 983, 4096):
                for hidden, per_sm in ((False, 5), (True, 4)):
                    splits = ld.dense_splits(rows, steps, sms, 128, hidden)
                    assert splits >= 1 and (splits == 1 or steps // splits >= ld.DENSE_SPLIT_STEPS), (rows, steps, splits)
                    if splits >= steps // ld.DENSE_SPLIT_STEPS:  # held back by the steps
                        continue
                    slots = sms * per_sm
                    waves = max(ld.DENSE_MIN_SPLITS, min(ld.DENSE_MAX_SPLITS, -(-ld.DENSE_WAVES * slots // rows)))
                    assert ld.DENSE_MIN_SPLITS <= splits <= ld.DENSE_MAX_SPLITS
                    if not whole or waves > ld.DENSE_MIN_SPLITS:  # the waves decide
                        assert (splits in (ld.DENSE_MIN_SPLITS, ld.DENSE_MAX_SPLITS)
                                or rows * (splits - 1) < ld.DENSE_WAVES * slots <= rows * splits), (rows, steps, splits)
                    else:  # the fewest splits decide: up to half as many more, never modelled slower
                        assert waves <= splits <= 3 * waves / 2, (rows, steps, splits)
                        assert modelled(rows, steps, splits, slots) <= modelled(rows, steps, waves, slots)
        assert ld.dense_splits(64, 983, sms, 128, True) < ld.dense_splits(64, 983, sms, 128, False)  # fewer programs an SM
        assert ld.dense_splits(64, 983, 66, 128, False) < ld.dense_splits(64, 983, 132, 128, False)  # half the SMs
    # 512 rows of 788 steps (B = 64 at 64K, 77% kept): 8 splits make 6.2 waves of 660 programs, 9 make 6.98
    monkeypatch.setattr(ld, "DENSE_WHOLE_WAVES", False)
    assert ld.dense_splits(512, 788, sms, 128, False) == 8
    monkeypatch.setattr(ld, "DENSE_WHOLE_WAVES", True)
    assert ld.dense_splits(512, 788, sms, 128, False) == 9


@pytest.mark.interpreter
def test_the_dense_launch_caps_registers_by_the_hidden_list_and_its_own_splits_match_the_twin(model, registry, monkeypatch):
    """The dense launch caps a thread's registers at 96 (128 with a hidden-slot list, which would spill at 96); asked
    for no number of programs it splits the rows as ``dense_splits`` says, and the output over those splits is the
    twin's."""
    from kvweave.kernels import lowbit_dense as ld

    view, rows = _post_rope_view(model, registry, "t-lowbit-post", 512)  # head_dim 128
    heads = view.exact_k.shape[1]
    q = torch.randn(rows, 4, 128, generator=torch.Generator().manual_seed(5))
    listed = attrs.evolve(view, hidden_slots=torch.full((rows * heads, 4), -1, dtype=torch.int32), hidden_below=None)
    assert plan_launch(view, q, None, 0.088, variant="dense").constants["maxnreg"] == 96
    assert plan_launch(listed, q, None, 0.088, variant="dense").constants["maxnreg"] == 128
    monkeypatch.setattr(ld, "DENSE_SPLIT_STEPS", 1)  # the view's few steps split as a long row's would
    steps = view.tokens // 64
    launch = plan_launch(view, q, None, 0.088, variant="dense", programs=None)
    assert steps >= 2 and launch.grid[1] == ld.dense_splits(rows * heads, steps, ld.DEFAULT_SMS, 128, False) == steps
    twin = torch_lowbit_decode(view, q, None, 0.088)
    assert torch.allclose(lowbit_decode(view, q, None, 0.088, variant="dense", programs=None), twin, atol=1e-5)


@pytest.mark.interpreter
def test_any_number_of_query_heads_a_kv_head_gives_the_twins_output(model, registry, monkeypatch):
    """Groups of 1, 3, 8 and 16 query heads a KV head (the dense tile's 8 rows, then 16; one column a head, or two for
    3), with a row's first visible position, restored sinks and a window buffer filled in part: the packed pass and
    either combine (a program per query head, its splits and rotation in one tile each or in loops, or per KV head past
    ``COMBINE_GROUP_ROWS`` rows), over several splits a row, give the twin's output."""
    from kvweave.kernels import lowbit_combine
    from kvweave.kernels import lowbit_decode as decode

    view, rows = _post_rope_view(model, registry, "t-lowbit-sinks-cg")
    assert view.restored_k is not None
    heads, dim = view.exact_k.shape[1], view.exact_k.shape[-1]
    filled = attrs.evolve(view, exact_fill=torch.tensor([view.exact_k.shape[-2] - 3], dtype=torch.int32))
    start = torch.tensor([40, 0][:rows], dtype=torch.int32)
    passes = {}  # per group: its query and the packed pass as lowbit_decode launches it, run once (it reads neither
    for group in (1, 3, 8, 16):  # the exact window nor the combine's settings; each combine below reads its outputs)
        q = torch.randn(rows, heads * group, dim, generator=torch.Generator().manual_seed(group))
        passes[group] = q, decode.plan_launch(view, q, start, dim ** -0.5, variant="dense", programs=4 * rows * heads)
        passes[group][1].run()
    for mode, (by_kv_head, whole) in enumerate(((False, True), (False, False), (True, False))):
        monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", 0 if by_kv_head else rows * heads)
        monkeypatch.setattr(lowbit_combine, "COMBINE_WHOLE_SPLITS", 64 if whole else 0)
        for turn, group in enumerate((1, 3, 8, 16)):
            q, packed = passes[group]
            # the full window and the one filled in part in turn: each combine and each group meets both
            stored = (view, filled)[(mode + turn) % 2]
            combine = decode.plan_combine(stored, q, start, dim ** -0.5, packed)
            assert combine.grid[0] == rows * heads * (1 if by_kv_head else group) and packed.grid[1] > 1
            assert combine.constants.get("WHOLE", False) == whole
            twin = torch_lowbit_decode(stored, q, start, dim ** -0.5)
            out = combine.run()[0]
            assert torch.allclose(out, twin, atol=1e-5), (by_kv_head, whole, group, (out - twin).abs().max())
    assert not torch.allclose(torch_lowbit_decode(filled, q, start, 0.125), torch_lowbit_decode(view, q, start, 0.125))


@pytest.mark.interpreter
def test_the_dense_kernel_reads_the_query_heads_in_the_models_dtype_where_they_are(model, registry):
    """The dense kernel reads the query heads from the caller's tensor (no zero-padded float32 copy before it): a
    bfloat16 query, also one that is a strided view of a larger tensor, gives the twin's output for its values, and
    the padding columns of a group of 3 change nothing."""
    view, rows = _post_rope_view(model, registry, "t-lowbit-post", 512)
    heads = view.exact_k.shape[1]
    for group in (3, 4):
        wide = torch.randn(rows, heads * group, 2, 128, generator=torch.Generator().manual_seed(group)).bfloat16()
        q = wide[:, :, 1]  # every other row of 128: not contiguous
        launch = plan_launch(view, q, None, 0.088, variant="dense")
        assert launch.args[0].dtype == torch.bfloat16 and launch.constants["QG"] == group
        twin = torch_lowbit_decode(view, q.float(), None, 0.088)
        out = lowbit_decode(view, q, None, 0.088, variant="dense")
        assert torch.allclose(out, twin, atol=1e-5), (group, (out - twin).abs().max())


def test_the_dense_kernel_pads_a_kv_heads_query_heads_to_8_rows_and_the_others_to_16(registry):
    """The dense kernel's query heads are its products' second operand (8 columns at least on a Hopper warpgroup): 4
    heads a KV head take 8 rows there, 16 in the kernels whose tiles are 16 rows; larger groups a power of two."""
    from kvweave.kernels.lowbit_decode import tile_rows

    view, rows = _post_rope_view(tiny_llama(layers=2, hidden=512), registry, "t-lowbit-post")
    heads = view.exact_k.shape[1]
    for group, dense, other in ((4, 8, 16), (2, 8, 16), (8, 8, 16), (16, 16, 16), (12, 16, 16)):
        assert (tile_rows(group, "dense"), tile_rows(group, "wide")) == (dense, other)
    q = torch.randn(rows, 4 * heads, 128)
    assert plan_launch(view, q, None, 0.088, variant="dense").constants["G"] == 8
    assert plan_launch(view, q, None, 0.088, variant="wide").constants["G"] == 16
    with pytest.raises(ValueError, match="query rows must be float32"):  # a caller's rows of the dense kernel's size
        plan_launch(view, q, None, 0.088, variant="wide", query_rows=torch.zeros(rows * heads, 8, 128))
    dense = plan_launch(view, q, None, 0.088, variant="dense", query_rows=torch.zeros(rows * heads, 16, 128))
    assert dense.args[0].data_ptr() == q.data_ptr() and dense.constants["QG"] == 4  # the query heads read in place


def test_the_combine_reads_a_rotation_over_128_channels_in_chunks(registry):
    """At head_dim 256 (Gemma-3's) the combine keeps its loops however few the splits: one 256 x 256 float32 rotation
    tile would take 512 registers a thread."""
    from kvweave.kernels.lowbit_decode import plan_combine

    view, _ = _post_rope_view(tiny_llama(layers=2, hidden=1024), registry, "prerope-k4v2-lowbit")
    q = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(6))
    start = torch.tensor([40, 0], dtype=torch.int32)
    packed = plan_launch(view, q, start, 0.0625)
    assert view.exact_k.shape[-1] == 256 and packed.grid[1] <= 64
    assert not plan_combine(view, q, start, 0.0625, packed).constants["WHOLE"]
