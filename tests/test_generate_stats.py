"""What the CLI reports: `kvweave generate`'s ratio against a 16-bit cache and against
the model's own cache in its compute dtype with a line for each part of the breakdown, and `kvweave resolve`
marking a shared slot that keys and values both replace."""

from __future__ import annotations

import torch

from kvweave.engine import build_cache
from kvweave.engine.generation import generate
from kvweave.tools.cli import BREAKDOWN_TERMS, main

from conftest import tiny_llama


def test_a_float32_model_reports_its_own_cache_beside_the_16_bit_one():
    model = tiny_llama(torch.float32)
    torch.manual_seed(0)
    inputs = {"input_ids": torch.randint(1, 128, (1, 300))}
    cache = build_cache("int4", model)
    _, stats = generate(model, inputs, cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert stats.model_dtype == "float32"
    assert stats.full_model_dtype_bytes == 2 * stats.full_16bit_bytes
    assert abs(stats.ratio_model_dtype - 2 * stats.ratio) < 1e-9
    assert stats.to_dict()["ratio_model_dtype"] == stats.ratio_model_dtype
    bf16 = tiny_llama(torch.bfloat16)
    _, half = generate(bf16, inputs, build_cache("int4", bf16), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert half.full_model_dtype_bytes == half.full_16bit_bytes


def test_generate_prints_both_ratios_and_explains_the_breakdown(tiny_model_folder, capsys):
    code = main(["generate", "--model", str(tiny_model_folder), "--pipeline", "int4", "--no-chat", "--dtype", "float32",
                 "--prompt", "one two three four five six seven eight nine ten " * 20, "--max-new-tokens", "3"])
    out = capsys.readouterr().out
    assert code == 0
    assert "vs a 16-bit cache" in out and "vs this model's float32 cache" in out
    for part in ("exact_window", "coefficients"):
        assert f"  {part}" in out and BREAKDOWN_TERMS[part] in out


def test_resolve_marks_a_shared_slot_both_kinds_replace(capsys):
    assert main(["resolve", "prerope-k3v2"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[3:]}
    assert "unused: keys and values have their own" in lines["quantizer"]
    assert "channel-group" in lines["keys.quantizer"] and "rotated-token" in lines["values.quantizer"]
    assert "unused" not in lines["residual_quantizer"]
