"""The dense kernel's last wave of splits made shorter (``kvweave.kernels.lowbit_tail.dense_tail``, ``DENSE_TAIL``):
the splits cover each token group once, the short ones last and about a wave's worth; off, or where the programs are one
wave, every split alike, as before; and the kernel over such splits gives the twin's output and the uniform splits'."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import lowbit_dense as ld
from kvweave.kernels import lowbit_tail
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

from conftest import CharTokenizer, tiny_llama
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


def _long_view(registry, prompt=560):  # noqa: F811 - the fixture
    """Layer 1's packed storage of ``t-lowbit-post`` at head_dim 128 after a ``prompt``-token prompt, two rows: the
    keys after RoPE, as the dense kernel reads them."""
    import attrs

    from kvweave.engine import build_cache, importance

    net = tiny_llama(layers=2, hidden=512)
    cache = build_cache(registry.resolve("t-lowbit-post"), net, tokenizer=CharTokenizer())
    ids = torch.randint(1, 128, (2, prompt), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        importance.prefill(net, cache, ids)
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    return attrs.evolve(view, inv_freq=None), 2


@pytest.mark.parametrize("percent", [0, 25, 33, 50, 67])
def test_the_splits_cover_each_group_once_with_the_short_ones_last(percent):
    for rows in (1, 8, 64, 256, 1024):
        for groups in (3, 64, 245, 491, 983, 1966):
            for splits in (1, 2, 8, 10, 31, 64):
                for slots in (528, 660):
                    count, long_len, long_count, short_len = lowbit_tail.dense_tail(rows, groups, splits, slots, percent)
                    starts = [i * long_len for i in range(long_count)]
                    starts += [long_count * long_len + i * short_len for i in range(count - long_count)]
                    lengths = [long_len] * long_count + [short_len] * (count - long_count)
                    assert 1 <= short_len <= long_len and long_count <= count
                    assert starts[-1] < groups <= starts[-1] + lengths[-1]  # every split holds a group, all are held
                    uniform = -(-groups // splits)
                    if percent == 0 or rows * splits <= slots or splits < 2:  # as before: every split alike
                        assert (count, long_len, long_count) == (-(-groups // uniform), uniform, count)
                    elif long_count < count:  # the short ones: about one wave's worth of programs, fewer splits
                        assert rows * (count - long_count) <= slots + rows and count <= splits
                        assert short_len == max(1, long_len * percent // 100)


@pytest.mark.interpreter
def test_the_kernel_over_a_shorter_last_wave_gives_the_twins_output(model, registry, monkeypatch):  # noqa: F811
    """With the SMs made to hold 8 programs at once, 4 rows of 8 steps in 4 splits are more than a wave; at 50% the last
    splits are shorter than the first (3 steps, then 1), and the output over them is the twin's and the uniform
    splits'."""
    view, rows = _long_view(registry)  # head_dim 128, 8 steps a row
    assert view.tokens // 64 == 8
    heads = view.exact_k.shape[1]
    q = torch.randn(rows, 4, 128, generator=torch.Generator().manual_seed(6))
    monkeypatch.setattr(ld, "DENSE_SPLIT_STEPS", 2)  # 4 splits of a row's 8 steps
    monkeypatch.setattr(ld, "dense_slots", lambda *args, **kwargs: 8)
    from kvweave.kernels import lowbit_decode as decode

    monkeypatch.setattr(decode, "dense_slots", lambda *args, **kwargs: 8)
    monkeypatch.setattr(lowbit_tail, "DENSE_TAIL", 0)
    uniform = lowbit_decode(view, q, None, 0.088, variant="dense", programs=None)
    monkeypatch.setattr(lowbit_tail, "DENSE_TAIL", 50)
    launch = plan_launch(view, q, None, 0.088, variant="dense", programs=None)
    names = ld.jit_dense._lowbit_dense_kernel.arg_names
    args = dict(zip(names, launch.args))
    assert rows * heads * launch.grid[1] > 8
    assert (launch.grid[1], args["long_splits"], args["split_len"], args["short_len"]) == (4, 2, 192, 64)
    twin = torch_lowbit_decode(view, q, None, 0.088)
    out = lowbit_decode(view, q, None, 0.088, variant="dense", programs=None)
    assert torch.allclose(out, twin, atol=1e-5) and torch.allclose(out, uniform, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel at real sizes on a CUDA GPU")
def test_on_a_gpu_the_shorter_last_wave_gives_the_uniform_splits_output(monkeypatch):
    """The 8x storage at B = 8, 32K (three waves): at 33% and 50% the output is the uniform splits' to the float32 sums'
    order (1e-2 of bfloat16 outputs of about 1)."""
    import sys
    from pathlib import Path

    import attrs

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    view = attrs.evolve(packed_view(8, 32768, device="cuda", storage="k4v2e48t"), inv_freq=None)
    q = torch.randn(8, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3)).cuda().bfloat16()
    monkeypatch.setattr(lowbit_tail, "DENSE_TAIL", 0)
    uniform = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, programs=None).float()
    for percent in (33, 50):
        monkeypatch.setattr(lowbit_tail, "DENSE_TAIL", percent)
        launch = plan_launch(view, q, None, HEAD_DIM ** -0.5, programs=None)
        args = dict(zip(ld.jit_dense._lowbit_dense_kernel.arg_names, launch.args))
        assert args["long_splits"] < launch.grid[1]
        out = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, programs=None).float()
        assert (out - uniform).abs().max() < 1e-2, (percent, float((out - uniform).abs().max()))
