"""Keys in token groups longer than the dense kernel's step (``KGROUP`` > ``BLOCK``) with the fold kept over a group's
steps (``FOLD_ONCE``, KVWEAVE_DENSE_FOLD=1; :func:`kvweave.kernels.lowbit_dense_triton._steps`'s ``GROUPED``): the
same output as folding every step and as the torch twin under Triton's interpreter, splits that begin inside a group
included."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.interpreter
@pytest.mark.parametrize("programs", [8, 64])  # one split a row; eight of one 64-token step (half begin inside a group)
def test_a_groups_fold_kept_over_its_steps_matches_a_fold_each_step_and_the_twin(monkeypatch, programs):
    import lowbit_kernel
    from kvweave.kernels import lowbit_dense_triton
    from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
    from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

    monkeypatch.setitem(lowbit_kernel.STORAGES, "k4g128v2t", (
        lambda: ChannelGroupQuantizer(bits=4, group=128, outliers=0),
        lambda: RotatedTokenQuantizer(bits=2, scale_format="log8", token_tiles=64), 0.5))
    view = lowbit_kernel.packed_view(1, 1024, device="cpu", storage="k4g128v2t")
    view = attrs.evolve(view, k_group=128, inv_freq=None)  # 512 slots: four groups of 128, keys after RoPE
    assert view.k_scale.shape[-2] == 4
    q = torch.randn(1, lowbit_kernel.Q_HEADS, lowbit_kernel.HEAD_DIM, generator=torch.Generator().manual_seed(5))
    scaling = lowbit_kernel.HEAD_DIM ** -0.5
    launch = plan_launch(view, q, None, scaling, variant="dense", programs=programs)
    assert (launch.constants["KGROUP"], launch.constants["BLOCK"]) == (128, 64) and launch.constants["KPLANES"]
    outs = {}
    for fold_once in (False, True):
        monkeypatch.setattr(lowbit_dense_triton, "FOLD_ONCE", fold_once)
        outs[fold_once] = lowbit_decode(view, q, None, scaling, variant="dense", programs=programs)
    twin = torch_lowbit_decode(view, q, None, scaling)
    assert torch.allclose(outs[True], outs[False], atol=1e-6), (outs[True] - outs[False]).abs().max()
    assert torch.allclose(outs[True], twin, atol=1e-5), (outs[True] - twin).abs().max()
    # a group's fold applied to the wrong group's tokens moves the output by far more than that
    wrong = attrs.evolve(view, k_scale=view.k_scale.roll(1, dims=-2), k_zero=view.k_zero.roll(1, dims=-2))
    assert (torch_lowbit_decode(wrong, q, None, scaling) - twin).abs().max() > 1e-2
