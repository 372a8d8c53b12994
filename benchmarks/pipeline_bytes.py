"""Print the real stored bytes of every pipeline in a registry after one prefill of real text.

    python benchmarks/pipeline_bytes.py [--model default] [--prompt-file F] [--dtype float32|bfloat16]

For each pipeline: tokens cached, tokens packed (left the exact window), the bytes by part, the ratio of
the packed part against 16 bits for the same tokens, and the ratio of the whole cache. Every byte is the
``nbytes`` of a tensor the cache holds.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvweave.engine import build_cache, cache_kwargs
from kvweave.tools.models import load_model
from kvweave.core.registry import load_registry

DEFAULT_PROMPT = Path(__file__).parents[1] / "examples" / "prompts" / "harbour-report.txt"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--prompt-file", default=str(DEFAULT_PROMPT))
    parser.add_argument("--registry")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    inputs = tokenizer(Path(args.prompt_file).read_text(), return_tensors="pt")
    registry = load_registry(args.registry)
    header = f"{'pipeline':<16}{'tokens':>7}{'packed':>7}{'exact B':>12}{'coeff B':>12}{'resid B':>11}{'basis B':>9}{'packed x':>10}{'whole x':>9}"
    print(header)
    print("-" * len(header))
    for name in registry.names():
        cache = build_cache(registry.resolve(name), model, tokenizer=tokenizer)
        with torch.inference_mode():
            model(**inputs, use_cache=True, **cache_kwargs(model, cache))
        parts = cache.memory_breakdown()
        packed = cache.engine.windows[0].compressed_tokens
        packed_bytes = parts["coefficients"] + parts["residuals"] + parts["basis_state"]  # observation apart
        packed_ratio = packed * cache.shape.kv_bytes_per_token_16bit / packed_bytes if packed_bytes else float("nan")
        print(
            f"{name:<16}{cache.get_seq_length():>7}{packed:>7}{parts['exact_window']:>12,}{parts['coefficients']:>12,}"
            f"{parts['residuals']:>11,}{parts['basis_state']:>9,}{packed_ratio:>10.2f}{cache.compression_ratio():>9.2f}"
        )


if __name__ == "__main__":
    main()
