"""Record each regression pipeline's tokens and stored bytes on the real default model.

``python tests/regression/record.py`` rewrites ``figures.json`` beside it; ``tests/test_regression.py``
compares the current code against the recorded figures. Re-record only for a change that is meant to
alter what a pipeline stores or generates, and say so in the commit.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).parent
PROMPT_FILE = HERE.parents[1] / "examples" / "prompts" / "harbour-report.txt"
PIPELINES = ("int4", "depthweave-kv", "freqdepthkv", "snapkv", "kivi-2")
NEW_TOKENS = 40  # enough decode steps for a block to leave the exact window while decoding


def run(pipeline: str, model, tokenizer) -> dict:
    """Generate greedily after the report with ``pipeline``; the new token ids and the stored bytes."""
    from kvweave.engine import build_cache
    from kvweave.engine.generation import generate

    text = PROMPT_FILE.read_text()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer([prompt], return_tensors="pt", add_special_tokens=False)
    cache = build_cache(pipeline, model, tokenizer=tokenizer)
    new_tokens, stats = generate(
        model, inputs, cache, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
    )
    return {
        "tokens": new_tokens[0].tolist(),
        "stored_bytes": stats.stored_bytes,
        "breakdown": stats.breakdown,
        "cached_tokens": stats.cached_tokens,
    }


def main() -> int:
    from kvweave.tools.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model("default", device="cpu")
    figures = {name: run(name, model, tokenizer) for name in PIPELINES}
    (HERE / "figures.json").write_text(json.dumps(figures, indent=1) + "\n")
    for name, record in figures.items():
        print(f"{name:16s} {record['stored_bytes']:>12,d} bytes  {len(record['tokens'])} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
