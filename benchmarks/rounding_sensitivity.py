"""How far a pipeline's greedy logits move when its input moves by float rounding: the yardstick for a kernel
that computes the same attention in another order (its logits differ from the reference path's by rounding,
and the codes of a cache can turn that into larger steps).

    python benchmarks/rounding_sensitivity.py --pipelines l-qa35v3 --registry benchmarks/lean_sweep.toml
    python benchmarks/rounding_sensitivity.py --pipelines l-qa35v3 --registry benchmarks/lean_sweep.toml --kernel-from prerope-qa35v3-lowbit

Generates greedily after the report in examples/prompts twice per pipeline, the second time with the input
embeddings scaled by ``1 + eps`` (or, with ``--kernel-from P``, with pipeline P's kernel in the kernel slot),
and prints the largest logit change at each step and whether the generated tokens are the same (CPU, the
model's dtype).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", required=True, help="comma-separated pipelines")
    parser.add_argument("--registry", default=None, help="a registry file read on top of the built-in one")
    parser.add_argument("--model", default="default")
    parser.add_argument("--eps", type=float, default=1e-6, help="relative change of the input embeddings")
    parser.add_argument("--steps", type=int, default=12, help="tokens generated")
    parser.add_argument("--kernel-from", default=None, help="compare with this pipeline's kernel instead of perturbing the input")
    args = parser.parse_args()
    import attrs

    from kvweave.core.registry import load_registry
    from kvweave.engine import build_cache, cache_kwargs
    from kvweave.engine.importance import score_for
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(args.model, device="cpu", progress=False)
    registry = load_registry(args.registry)
    text = (ROOT / "examples" / "prompts" / "harbour-report.txt").read_text()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
    weight = model.get_input_embeddings().weight
    base = weight.data.clone()
    what = f"kernel of {args.kernel_from}" if args.kernel_from else f"input x (1 + {args.eps:g})"
    print(f"| pipeline | largest logit change per step ({what}) | same tokens |\n|---|---|---|")
    try:
        for name in [n.strip() for n in args.pipelines.split(",") if n.strip()]:
            scores, tokens = [], []
            pipeline = registry.resolve(name)
            for second in (False, True):
                run = pipeline
                if second and args.kernel_from:
                    run = attrs.evolve(pipeline, slots={**pipeline.slots, "kernel": registry.resolve(args.kernel_from).slots["kernel"]})
                weight.data.copy_(base * (1 + (args.eps if second and not args.kernel_from else 0.0)))
                cache = build_cache(run, model, tokenizer=tokenizer)
                score_for(model, cache, ids)  # a pipeline that evicts by context importance scores the prompt first
                with torch.no_grad():
                    out = model.generate(input_ids=ids, max_new_tokens=args.steps, min_new_tokens=args.steps, do_sample=False,
                                         output_scores=True, return_dict_in_generate=True, pad_token_id=tokenizer.pad_token_id,
                                         **cache_kwargs(model, cache))
                scores.append(out.scores)
                tokens.append(out.sequences)
            changes = [float((a - b)[torch.isfinite(a) & torch.isfinite(b)].abs().max()) for a, b in zip(*scores)]  # (EOS held at -inf)
            print(f"| `{name}` | {', '.join(f'{c:.2g}' for c in changes)} | {'yes' if torch.equal(*tokens) else 'no'} |")
    finally:
        weight.data.copy_(base)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
