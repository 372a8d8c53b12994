"""Where KVzip's reconstruction scores put a needle cell's kept tokens (docs/frontier.md, "Dropping tokens
before the question"): the share of each fifth of the context kept at ``--fraction``, per chunk size and
share, and each layer's mean rank of the needle's tokens among its scores (0 = most important).

    python benchmarks/kvzip_positions.py --length 2000 --depth 0.1 --needle 0 [--pools 1,7] [--spreads none,segments]
        [--fraction 0.5] [--model M]

Layers the scorer cannot see whole (sliding-window layers) are left out of every share and rank.

The cell is the one ``kvweave eval needle`` builds (query-agnostic: the context part only, chat template where
the model has one), scored on the CPU in float32.
"""

from __future__ import annotations

import argparse


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--length", type=int, default=2000)
    parser.add_argument("--depth", type=float, default=0.1)
    parser.add_argument("--needle", type=int, default=0, help="index of the needle (of 16, seed 0)")
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--chunks", default="2048,512,256", help="scoring chunk sizes")
    parser.add_argument("--pools", default="1", help="kvzip pool widths compared (scores max-pooled over that many positions)")
    parser.add_argument("--spreads", default="none", help="kvzip spreads compared: none (one cut per layer and head), "
                        "segments (each 128 positions keep the layer's share)")
    args = parser.parse_args()
    args.sinks_shown = 4  # the first positions are kept whatever their score
    import torch

    from kvweave.core.registry import load_registry
    from kvweave.engine import importance
    from kvweave.plugins.evictors.kvzip import KVzipEvictor
    from kvweave.tools import datasets
    from kvweave.tools.data import essays_text
    from kvweave.tools.eval_context import Evaluation
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(args.model, device="cpu", progress=False)
    ev = Evaluation(model, tokenizer, load_registry(None), [], None, progress=False)
    needle = datasets.make_needles(16, 0)[args.needle]
    cell = datasets.needle_cell(tokenizer, essays_text(), needle, args.needle, args.length, args.depth, 0, 1)
    inputs, split = ev.encode_split(cell.context, cell.question)
    ids = inputs["input_ids"][:, :split]
    pieces = [tokenizer.decode([t]) for t in ids[0].tolist()]
    span = datasets.pieces_over(pieces, "".join(pieces).find(needle.answer), len(needle.answer))
    print(f"context {split} tokens, needle {needle.answer!r} at tokens {span[0]}-{span[-1]}\n")
    print("| chunk | share | spread | pool | kept of the needle's entries | kept of each fifth of the context |\n|---|---|---|---|---|---|")
    ranks = None
    for chunk in (int(c) for c in args.chunks.split(",")):
        raw = importance.reconstruction_scores(model, tokenizer, ids, chunk=chunk)
        scored = torch.isfinite(raw[:, 0, :, args.sinks_shown:]).any(-1).any(-1)  # layers the scorer sees whole
        for pool in (int(p) for p in args.pools.split(",")):
            scores = KVzipEvictor(pool=pool).prepare_importance(raw)
            total = scores.shape[-1]
            for share in ("model", "layer"):
                for spread in args.spreads.split(","):
                    evictor = KVzipEvictor(fraction=args.fraction, share=share, spread=spread)
                    if spread == "segments":  # each token's own cut [L, B, H, T]
                        kept = (scores >= evictor.segment_cuts(scores))[:, 0][scored]
                    else:
                        kept = (scores[:, 0] >= evictor.cuts(scores)[:, 0, :, None])[scored]  # [L, H, T], scored layers only
                    fifths = [float(kept[..., total * f // 5 : total * (f + 1) // 5].float().mean()) for f in range(5)]
                    print(f"| {chunk} | {share} | {spread} | {pool} | {float(kept[..., span].float().mean()):.2f} | "
                          f"{', '.join(f'{x:.2f}' for x in fifths)} |")
        scores = raw
        if ranks is None:
            order = scores[:, 0].argsort(-1, descending=True).argsort(-1).float() / total  # [L, H, T]
            ranks = [float(order[layer][:, span].mean()) for layer in range(order.shape[0]) if bool(scored[layer])]
    print("\nmean rank of the needle's tokens per scored layer (first chunk size; 0 = most important):")
    print(", ".join(f"{layer}: {rank:.2f}" for layer, rank in enumerate(ranks)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
