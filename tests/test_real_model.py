"""End to end on the real default model (SmolLM2-135M-Instruct) with real text."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

from kvweave.core import build_cache, cache_kwargs
from kvweave.core.generation import generate

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
    packed_tokens = cache.engine.windows[0].compressed_tokens
    assert packed_tokens >= 512
    packed_16bit = packed_tokens * cache.shape.kv_bytes_per_token_16bit
    assert packed_16bit / parts["coefficients"] > expected
    assert stats.stored_bytes == sum(parts.values()) and stats.stored_bytes < 4 * stats.full_16bit_bytes / 2
