"""benchmarks/layer_sensitivity.py: the pure allocation, the per-head round trip and the hook/KL machinery on
tiny random models (no text, no real model)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from conftest import tiny_llama


def _script():
    path = Path(__file__).parents[1] / "benchmarks" / "layer_sensitivity.py"
    spec = importlib.util.spec_from_file_location("layer_sensitivity", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


sens = _script()


# --------------------------------------------------------------------------------------- allocation
def test_allocate_moves_the_largest_gains():
    gains = [0.1, 0.5, 0.05, 0.9, 0.3, 0.0]
    assert sens.allocate(gains, 2, 3, 2.5) == [2, 3, 2, 3, 3, 2]
    assert sens.allocate(gains, 2, 3, 2.0) == [2] * 6
    assert sens.allocate(gains, 2, 3, 3.0) == [3] * 6
    assert sens.allocate(gains, 3.0, 4.0, 3.5) == [3.0, 4.0, 3.0, 4.0, 4.0, 3.0]


@pytest.mark.parametrize("mean", [2.0, 2.25, 2.5, 2.75, 3.0])
def test_allocate_count_matches_the_mean(mean):
    gains = [float(i % 7) for i in range(30)]
    table = sens.allocate(gains, 2, 3, mean)
    assert table.count(3) == round((mean - 2) * 30)
    assert abs(sum(table) / len(table) - mean) <= 0.5 / 30 + 1e-12


def test_allocate_ties_go_to_the_earlier_layer():
    assert sens.allocate([1.0, 1.0, 1.0, 1.0], 2, 3, 2.5) == [3, 3, 2, 2]


@pytest.mark.parametrize("low, high, mean", [(2, 3, 1.9), (2, 3, 3.1), (3, 3, 3), (4, 3, 3.5)])
def test_allocate_refuses_a_mean_outside_or_an_empty_range(low, high, mean):
    with pytest.raises(ValueError, match="mean|low"):
        sens.allocate([0.1, 0.2], low, high, mean)


def test_evenly_spaces_the_same_count():
    assert sens.evenly(6, 2, 3, 2.5) == [2, 3, 2, 3, 2, 3]
    assert sens.evenly(4, 2, 3, 2.0) == [2] * 4 and sens.evenly(4, 2, 3, 3.0) == [3] * 4
    assert sens.evenly(30, 2, 3, 2.25).count(3) == sens.allocate([0.0] * 30, 2, 3, 2.25).count(3)


def test_cli_refuses_a_mean_outside_the_range(capsys):
    with pytest.raises(SystemExit) as exc:
        sens.main(["--kind", "values", "--low", "2", "--high", "3", "--mean", "3.5"])
    assert exc.value.code == 2
    assert "3.5" in capsys.readouterr().err


def test_cli_refuses_a_width_the_quantizer_does_not_take(capsys):
    with pytest.raises(SystemExit):
        sens.main(["--kind", "values", "--low", "2", "--high", "8", "--mean", "3"])
    assert "--high 8" in capsys.readouterr().err


def test_compact_lists():
    assert sens.compact([2, 3, 2], "values") == "[2, 3, 2]"
    assert sens.compact([3.0, 4.0, 3.5], "keys") == "[3.0, 4.0, 3.5]"


# --------------------------------------------------------------------------------------- round trip
def test_round_trip_is_per_head_in_every_layout():
    torch.manual_seed(1)
    heads, dim, tokens = 2, 16, 64
    quantizer = sens.make_quantizer("keys", 3.0)
    bthd = torch.randn(1, tokens, heads, dim)
    expected = quantizer.dequantize(quantizer.quantize(bthd.transpose(1, 2)), torch.float32)  # [B, H, T, D]
    flat = sens.round_trip(bthd.reshape(1, tokens, heads * dim), quantizer, heads, dim)
    assert torch.equal(flat.reshape(1, tokens, heads, dim).transpose(1, 2), expected)
    assert torch.equal(sens.round_trip(bthd, quantizer, heads, dim).transpose(1, 2), expected)
    assert torch.equal(sens.round_trip(bthd.transpose(1, 2).contiguous(), quantizer, heads, dim), expected)


def test_round_trip_leaves_the_positions_past_whole_groups_exact_in_every_layout():
    """A needle prompt of 100 tokens: the first 64 quantized as a 64-token prompt would be, the last 36 (question and
    answer, which a cache has not packed) untouched."""
    torch.manual_seed(2)
    heads, dim, tokens = 2, 16, 100
    quantizer = sens.make_quantizer("keys", 3.0)
    bthd = torch.randn(1, tokens, heads, dim)
    body = sens.round_trip(bthd[:, :64].contiguous(), quantizer, heads, dim)
    for out in (sens.round_trip(bthd, quantizer, heads, dim),
                sens.round_trip(bthd.reshape(1, tokens, heads * dim), quantizer, heads, dim).reshape(1, tokens, heads, dim),
                sens.round_trip(bthd.transpose(1, 2).contiguous(), quantizer, heads, dim).transpose(1, 2)):
        assert torch.equal(out[:, 64:], bthd[:, 64:])
        assert torch.equal(out[:, :64], body) and not torch.equal(out[:, :64], bthd[:, :64])


def test_valid_width():
    assert sens.valid_width("values", 3, 64) and not sens.valid_width("values", 2.5, 64)
    assert sens.valid_width("keys", 3.5, 64) and sens.valid_width("keys", 3.125, 64)
    assert not sens.valid_width("keys", 3.1, 64)


# --------------------------------------------------------------------------------------- hooks and KL
def test_kl_per_layer_on_a_tiny_llama():
    model = tiny_llama(torch.float32, layers=2)  # 4 heads, 2 KV heads, head_dim 16
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(2))
    exact = sens.log_probs(model, ids)
    values = sens.kl_per_layer(model, ids, "values", [2, 4], exact, progress=False)
    keys = sens.kl_per_layer(model, ids, "keys", [3.0, 8.0], exact, progress=False)
    assert len(values) == len(keys) == 2
    for low, high in values + keys:
        assert math.isfinite(low) and low > 0 and math.isfinite(high) and high >= 0
        assert high < low / 4  # more bits, far less divergence
    # no hook is left behind: an unperturbed forward gives the exact distribution again
    assert sens.mean_kl(model, ids, exact, "values", {}) == pytest.approx(0, abs=1e-12)
    whole = sens.whole_model_kl(model, ids, exact, "values", {"2": [2, 2], "4": [4, 4]})
    assert whole["4"] < whole["2"] and whole["2"] >= max(low for low, _ in values) * 0.5


def test_kl_at_chosen_rows_averages_those_rows_only_and_samples_average():
    model = tiny_llama(torch.float32, layers=2)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(4))
    rows = torch.tensor([20, 50, 51])
    exact_all = sens.log_probs(model, ids)
    exact_rows = sens.log_probs(model, ids, rows)
    assert torch.allclose(exact_rows, exact_all[rows])
    table = {0: 2, 1: 2}
    each = [sens.mean_kl(model, ids, exact_all[[r]], "values", table, torch.tensor([r])) for r in rows.tolist()]
    assert sens.mean_kl(model, ids, exact_rows, "values", table, rows) == pytest.approx(sum(each) / 3, rel=1e-9)
    assert min(each) > 0  # positions within the quantized first 64 and past them both see the perturbed values
    whole = sens.mean_kl(model, ids, exact_all, "values", table)
    assert whole != pytest.approx(sum(each) / 3)
    samples = [sens.Sample(ids, exact_rows, rows), sens.Sample(ids, exact_all)]
    assert sens.samples_kl(model, samples, "values", table) == pytest.approx((sum(each) / 3 + whole) / 2, rel=1e-9)
    per_layer = sens.kl_per_layer(model, samples, "values", [2, 4], progress=False)
    assert len(per_layer) == 2 and all(high < low for low, high in per_layer)


def test_cli_refuses_short_needle_prompts_and_no_prompts(capsys):
    for extra, message in ((["--tokens", "100"], "at least 256"), (["--prompts", "0"], "--prompts must be >= 1")):
        with pytest.raises(SystemExit):
            sens.parse(["--kind", "values", "--mean", "2.5", "--text", "needles", *extra])
        assert message in capsys.readouterr().err
    assert sens.parse(["--kind", "values", "--mean", "2.5", "--text", "needles", "--tokens", "300"]).tokens == 300


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_keys_hook_sits_on_k_norm(family):
    """Qwen3's k_norm returns [B, T, H, D], Gemma-3's [B, H, T, D]: both are quantized per head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = {"model_type": "gemma3_text", "query_pre_attn_scalar": 16, "sliding_window": 32} if family == "gemma3" else {}
    config = AutoConfig.for_model(
        extra.pop("model_type", "qwen3"), vocab_size=128, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, **extra,
    )
    model = AutoModelForCausalLM.from_config(config).eval()
    layer = sens.decoder_layers(model)[0]
    assert sens.target_module(layer, "keys") is layer.self_attn.k_norm
    ids = torch.randint(0, 128, (1, 64), generator=torch.Generator().manual_seed(3))
    (low, high), _ = sens.kl_per_layer(model, ids, "keys", [3.0, 8.0], progress=False)
    assert math.isfinite(low) and low > 0 and high < low / 4


# --------------------------------------------------------------------------------------- allocation by bytes
def test_allocate_by_bytes_with_equal_weights_is_the_count_table():
    gains = [0.1, 0.5, 0.05, 0.9, 0.3, 0.0]
    assert sens.allocate_by_bytes(gains, [1.0] * 6, 2, 3, 2.5) == sens.allocate(gains, 2, 3, 2.5)
    # where allocate rounds the count up, the byte table stays under the mean
    assert sens.allocate_by_bytes(gains, [1.0] * 6, 2, 3, 2.4) == [2, 3, 2, 3, 2, 2]


def test_allocate_by_bytes_widens_the_cheap_layers_first_within_the_budget():
    gains = [1.0, 0.9, 0.2, 0.2]
    weights = [10.0, 10.0, 1.0, 1.0]  # two global layers, two short windows
    table = sens.allocate_by_bytes(gains, weights, 2, 4, 3.5)
    assert table == [4, 2, 4, 4]  # 0.2 a token beats 0.1 and 0.09; then one global layer fits the rest
    assert sens.weighted_mean(table, weights) <= 3.5
    assert sens.allocate(gains, 2, 4, 3.5) == [4, 4, 4, 2]  # by KL alone: the globals first
    assert sens.allocate_by_bytes(gains, weights, 2, 4, 2.5) == [2, 2, 4, 4]  # no global layer fits
    assert sens.allocate_by_bytes(gains, weights, 2, 4, 2.1) == [2, 2, 4, 2]


@pytest.mark.parametrize("weights, match", [([1.0], "1 weights for 2"), ([1.0, 0.0], "positive")])
def test_allocate_by_bytes_refuses_bad_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        sens.allocate_by_bytes([0.1, 0.2], weights, 2, 3, 2.5)


def test_held_tokens_reads_the_layer_types_and_the_window():
    from types import SimpleNamespace

    config = SimpleNamespace(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                             sliding_window=512)
    assert sens.held_tokens(config, 5000, 0.5, None) == [512.0, 2500.0, 512.0]
    assert sens.held_tokens(config, 5000, 0.5, 192) == [192.0, 2500.0, 192.0]
    assert sens.held_tokens(config, 100, 1.0, None) == [100.0, 100.0, 100.0]
    assert sens.held_tokens(SimpleNamespace(num_hidden_layers=2), 64, 1.0, None) == [64.0, 64.0]
    with pytest.raises(ValueError, match="sliding_window"):
        sens.held_tokens(SimpleNamespace(num_hidden_layers=1, layer_types=["sliding_attention"]), 64, 1.0, None)


def test_cli_refuses_bad_held_settings(capsys):
    for argv, match in ((["--held", "0"], "--held"), (["--held", "100", "--kept", "1.5"], "--kept"),
                        (["--held", "100", "--window", "0"], "--window")):
        with pytest.raises(SystemExit):
            sens.parse(["--kind", "values", "--mean", "2.5", *argv])
        assert match in capsys.readouterr().err
