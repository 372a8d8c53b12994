"""The ``dense`` kernel's codes loaded a step before the step that reads them (``AHEAD``: key words, value tiles' words)
and its 128-register build: the same output as the kernel that loads each step's codes where it reads them, under
Triton's interpreter (CI) and on a GPU at a real size; the launch's rule (the values' words ahead at 128 registers
where the programs are one wave at those registers), its switch and the settings' refusals."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, importance
from kvweave.kernels import lowbit_dense
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode

from conftest import CharTokenizer, tiny_llama
from env_settings import check_env_setting

SWEEP = Path(__file__).resolve().parents[1] / "benchmarks" / "dense_sweep.toml"


@pytest.fixture(scope="module")
def tiled_views():
    """Layer 1 of a 300-token prompt through the 8x and ~5x storages with values in tiles (head_dim 128), and the 8x
    storage with its values token by token."""
    registry = load_registry(SWEEP)
    net = tiny_llama(layers=2, hidden=512)
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    views = {}
    for name in ("kzd-k4v2t-f48-d128", "kzd-k4v4t-f77-d128", "kzd-k4v2-f48-d128"):
        cache = build_cache(registry.resolve(name), net, tokenizer=CharTokenizer())
        with torch.no_grad():
            importance.prefill(net, cache, ids)
        views[name] = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    return views


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["kzd-k4v2t-f48-d128", "kzd-k4v4t-f77-d128"])
def test_codes_loaded_a_step_ahead_give_the_same_output(tiled_views, name, monkeypatch):
    """Keys' and values' words loaded a step ahead are the same words: the same output bit for bit, in splits of one
    step (the next step's load re-reads the last) and of several, with a list of hidden slots (whose steps run in three
    stretches, each loading its first step before its loop), and within the twin's float32 rounding."""
    monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_WAVE", False)  # the launch's build loads each step's codes in place
    view = tiled_views[name]
    steps = view.tokens // 64
    assert view.v_tiled and steps >= 2
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    heads = view.exact_k.shape[1]
    assert view.hidden_below is not None  # the sinks: the packed pass's first visible position
    hidden = torch.full((heads, 8), -1, dtype=torch.int32)  # the sinks' slots and two more, as a list the steps check
    hidden[:, :4] = view.hidden_slots
    hidden[:, 4], hidden[0, 5] = 70, view.tokens - 3
    for stored in (view, attrs.evolve(view, hidden_slots=hidden, hidden_below=None)):
        twin = torch_lowbit_decode(stored, q, None, 128 ** -0.5)
        for programs in (heads, heads * steps):  # one split a row of every step, and a split a step
            plain = lowbit_decode(stored, q, None, 128 ** -0.5, variant="dense", programs=programs)
            assert torch.allclose(plain, twin, atol=1e-5)
            for tricks in ("kahead", "vahead", "kahead+vahead+r128"):
                out = lowbit_decode(stored, q, None, 128 ** -0.5, variant="dense", programs=programs, tricks=tricks)
                assert torch.equal(out, plain), (tricks, programs, (out - plain).abs().max())


def test_the_launch_loads_values_ahead_where_its_programs_are_one_wave_at_128_registers(tiled_views, monkeypatch):
    """The rule (``DENSE_AHEAD_WAVE``, on unless KVWEAVE_DENSE_AHEAD=0): a launch whose programs fit the SMs at 128
    registers a thread (4 programs of 4 warps an SM) loads the value tiles' words ahead at 128 registers, and
    counts its wave for the early combine at those registers; more programs keep the 96-register build and load where
    they read; 2- and 4-bit value tiles take it (widths outside DENSE_AHEAD_BITS do not), values token by token are
    loaded where they are read. The rule off, only the settings asked for apply."""
    tiled, flat = tiled_views["kzd-k4v2t-f48-d128"], tiled_views["kzd-k4v2-f48-d128"]
    q = torch.randn(1, 8, 128)
    scale = 128 ** -0.5
    monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_WAVE", True)
    slots = lowbit_dense.dense_slots(lowbit_dense.DEFAULT_SMS, 128, False, 4, 128)
    assert slots == 4 * lowbit_dense.DEFAULT_SMS
    one_wave = plan_launch(tiled, q, None, scale, variant="dense", programs=8)
    assert one_wave.constants["AHEAD"] == 2 and one_wave.constants["maxnreg"] == 128
    four_bit = plan_launch(tiled_views["kzd-k4v4t-f77-d128"], q, None, scale, variant="dense", programs=8)
    assert four_bit.constants["AHEAD"] == 2 and four_bit.constants["maxnreg"] == 128  # the ~5x class's 4-bit values
    monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_BITS", (2,))
    four_bit = plan_launch(tiled_views["kzd-k4v4t-f77-d128"], q, None, scale, variant="dense", programs=8)
    assert four_bit.constants["AHEAD"] == 0  # a width the rule does not take: loaded where read
    token_major = plan_launch(flat, q, None, scale, variant="dense", programs=8)
    assert token_major.constants["AHEAD"] == 0 and token_major.constants["maxnreg"] == lowbit_dense.DENSE_MAX_REGISTERS
    many = attrs.evolve(tiled, tokens=tiled.tokens * slots, k_codes=tiled.k_codes.repeat(1, slots, 1))
    waves = plan_launch(many, q, None, scale, variant="dense", programs=2 * slots)
    assert waves.grid[0] * waves.grid[1] > slots
    assert waves.constants["AHEAD"] == 0 and waves.constants["maxnreg"] == lowbit_dense.DENSE_MAX_REGISTERS
    monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_WAVE", False)
    assert plan_launch(tiled, q, None, scale, variant="dense", programs=8).constants["AHEAD"] == 0
    asked = plan_launch(tiled, q, None, scale, variant="dense", programs=8, tricks="kahead+vahead+r128")
    assert asked.constants["AHEAD"] == 3 and asked.constants["maxnreg"] == 128


def test_the_rule_is_switched_off_from_the_environment_and_a_wrong_value_refused():
    check_env_setting("KVWEAVE_DENSE_AHEAD", "from kvweave.kernels import lowbit_dense; print(lowbit_dense.DENSE_AHEAD_WAVE)",
                      {"0": "False", "on": "True"}, "sometimes")


def test_a_register_cap_from_the_environment_replaces_the_rules_in_the_build_and_in_the_waves(tiled_views, monkeypatch):
    """KVWEAVE_DENSE_REGISTERS (to time a build against its spills): every launch takes that cap, one wave or several,
    and counts its slots at it (168 registers: 3 programs of 4 warps an SM, so fewer programs make a wave than at
    128); a value it does not list is refused by name."""
    tiled = tiled_views["kzd-k4v2t-f48-d128"]
    q = torch.randn(1, 8, 128)
    monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_WAVE", True)
    monkeypatch.setattr(lowbit_dense, "DENSE_REGISTERS", 168)
    slots = lowbit_dense.dense_slots(lowbit_dense.DEFAULT_SMS, 128, False, 4)
    assert slots == 3 * lowbit_dense.DEFAULT_SMS < lowbit_dense.dense_slots(lowbit_dense.DEFAULT_SMS, 128, False, 4, 128)
    assert plan_launch(tiled, q, None, 0.1, variant="dense", programs=8).constants["maxnreg"] == 168
    many = attrs.evolve(tiled, tokens=tiled.tokens * slots, k_codes=tiled.k_codes.repeat(1, slots, 1))
    waves = plan_launch(many, q, None, 0.1, variant="dense", programs=2 * slots)
    assert waves.grid[0] * waves.grid[1] > slots and waves.constants["maxnreg"] == 168
    check_env_setting("KVWEAVE_DENSE_REGISTERS",
                      "from kvweave.kernels import lowbit_dense; print(lowbit_dense.dense_registers(128, False))",
                      {"0": str(lowbit_dense.DENSE_MAX_REGISTERS), "255": "255"}, "100")


def test_the_settings_refuse_what_they_cannot_change(tiled_views):
    q = torch.randn(1, 8, 128)
    with pytest.raises(ValueError, match="loads value tiles' words a step ahead: it takes values stored in tiles"):
        plan_launch(tiled_views["kzd-k4v2-f48-d128"], q, None, 0.1, variant="dense", tricks="vahead")
    with pytest.raises(ValueError, match=r"\['kahead'\] are launch settings of the 'dense' kernel, not of the 'wide'"):
        lowbit_decode(attrs.evolve(tiled_views["kzd-k4v2-f48-d128"]), q, None, 0.1, variant="wide", tricks="kahead")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the dense kernel for a CUDA GPU")
@pytest.mark.parametrize("storage", ["k4v2e48t", "k4v4e77t"])
def test_codes_loaded_ahead_agree_with_the_kernel_that_loads_them_in_place_on_the_gpu(storage, monkeypatch):
    """32,768 packed tokens, one row (the launch's rule: values ahead at 128 registers) and two, and every setting
    by name: each build gives the in-place build's output to the float32 sums' rounding, all within the twin's bound."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view

    for rows in (1, 2):
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)).cuda()
        twin = torch_lowbit_decode(view, q, None, HEAD_DIM ** -0.5)
        noise = float((torch_lowbit_decode(view, q.bfloat16().float(), None, HEAD_DIM ** -0.5) - twin).abs().max())
        bound = 0.03 * float(twin.abs().max()) + 6 * noise
        assert plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None).constants["AHEAD"] == (
            2 if rows == 1 and view.v_bits in lowbit_dense.DENSE_AHEAD_BITS else 0)
        rule = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        monkeypatch.setattr(lowbit_dense, "DENSE_AHEAD_WAVE", False)
        plain = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None)
        assert float((plain - twin).abs().max()) < bound
        for out in (rule, *(lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense", programs=None, tricks=t)
                            for t in ("kahead+vahead+r128", "vahead"))):
            assert float((out - twin).abs().max()) < bound
            assert torch.allclose(out, plain, rtol=1e-4, atol=1e-5), float((out - plain).abs().max())
        monkeypatch.undo()
