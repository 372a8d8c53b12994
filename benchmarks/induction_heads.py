"""Which layers of a model copy from their context: induction scores per layer and KV head, and the layers to
name in the ``kvzip`` evictor's ``keep_layers``.

    python benchmarks/induction_heads.py [--model default] [--length 200] [--seeds 3] [--threshold 0.3]

An induction head (Olsson et al., "In-context Learning and Induction Heads", 2022) completes ``A B ... A`` with
``B``: at the second ``A`` it attends to the token after the first one. That is how a model answers a needle
question from its context, so these are the heads whose entries an evictor should not thin (Wu et al.,
"Retrieval Head Mechanistically Explains Long-Context Factuality", arXiv:2404.15574, find the copying heads
few and fixed per model; RazorAttention, arXiv:2407.15891, scores them the same way). The score: random token
ids repeated twice after the BOS token; for each query position in the second copy, the attention it gives to
the position after its earlier occurrence, averaged over the positions and ``--seeds`` sequences; each KV head
takes the largest score of its query heads (the KV head is what the cache stores). The scores are
``kvweave.engine.copying``'s, the ones the ``kvzip`` evictor's ``copying`` threshold reads.

Prints the scores (layers as rows), the KV heads at or above ``--threshold``, and the ``keep_layers`` line
(every layer with one). ``--json F`` writes the table. CPU, the model's own dtype from ``load_model``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--length", type=int, default=200, help="random tokens per copy (two copies must fit the model's windows)")
    parser.add_argument("--seeds", type=int, default=3, help="random sequences averaged")
    parser.add_argument("--threshold", type=float, default=0.3, help="score at which a KV head counts as copying")
    parser.add_argument("--json", help="write the table here")
    args = parser.parse_args()
    if args.length < 8 or args.seeds < 1 or not 0.0 < args.threshold < 1.0:
        parser.error("--length must be >= 8, --seeds >= 1 and --threshold in (0, 1)")

    from kvweave.engine.copying import induction_scores, random_ids
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(args.model, device="cpu", progress=False)
    ids = random_ids(len(tokenizer), tokenizer.bos_token_id, args.length, args.seeds)
    scores = induction_scores(model, ids, args.length)
    layers, heads = scores.shape
    print(f"induction score per layer and KV head ({args.model}, {args.seeds} x {args.length} random tokens repeated):\n")
    print("| layer | " + " | ".join(f"head {h}" for h in range(heads)) + " |")
    print("|---:|" + "---:|" * heads)
    for layer in range(layers):
        print(f"| {layer} | " + " | ".join(f"{float(v):.2f}" for v in scores[layer]) + " |")
    chosen = [(layer, head) for layer in range(layers) for head in range(heads) if float(scores[layer, head]) >= args.threshold]
    keep = sorted({layer for layer, _ in chosen})
    print(f"\nKV heads scoring >= {args.threshold}: " + (", ".join(f"{l}.{h} ({float(scores[l, h]):.2f})" for l, h in chosen) or "none"))
    print(f"keep_layers = {keep}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "length": args.length, "seeds": args.seeds,
                                               "threshold": args.threshold, "scores": scores.tolist(), "keep_layers": keep}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
