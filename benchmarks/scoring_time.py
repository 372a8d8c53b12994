"""KVzip's context scoring timed by its parts: the whole scoring by each read-out backend (``torch``: the
probabilities formed whole; ``triton``: the kernels of ``kvweave.kernels.scoring``), and the same forwards with the
read-out left out (the context pass and the repetition forwards alone), and the Triton read-out with each repetition's
attention as one flash call instead of the split of ``kvweave.engine.split_attention`` (cuDNN over the context, merged
with the causal part), on a Llama-3-8B-shaped model with random bf16 weights; the largest differences between the
scores. A table on stdout.

    python benchmarks/scoring_time.py [--tokens 32768] [--reps 2] [--smoke]

``--smoke``: a tiny model of the same head shape on the CPU, Triton in its interpreter (checks the script).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv:  # the Triton kernels run in the interpreter on a CPU (set before they are imported)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_e2e  # noqa: E402
from kvweave.engine import importance  # noqa: E402


def timed(fn) -> tuple[float, object]:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--reps", type=int, default=2, help="timed runs of each case (the best is shown)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU")
    args = parser.parse_args()
    device = "cpu" if args.smoke else "cuda"
    config = decode_e2e.smoke_config(2) if args.smoke else decode_e2e.llama3_8b()
    model = decode_e2e.random_model(config, device)
    tokenizer = decode_e2e.Ids(model.config.vocab_size)
    ids = torch.randint(100, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0)).to(device)
    chunk = 64 if args.smoke else 2048
    score = lambda backend: importance.reconstruction_scores(model, tokenizer, ids, chunk=chunk, backend=backend)  # noqa: E731
    for backend in ("torch", "triton"):  # warm-up: the kernels' builds, cuBLAS plans
        importance.reconstruction_scores(model, tokenizer, ids[:, : min(args.tokens, 4096)], chunk=chunk, backend=backend)
    best: dict[str, float] = {}
    scores: dict[str, torch.Tensor] = {}
    for _ in range(args.reps):
        for backend in ("torch", "triton"):
            seconds, scores[backend] = timed(lambda: score(backend))
            best[backend] = min(best.get(backend, seconds), seconds)
        hook = importance._Scorer._hook
        importance._Scorer._hook = lambda *a: None  # the forwards alone
        try:
            seconds, _ = timed(lambda: score("torch"))
        finally:
            importance._Scorer._hook = hook
        best["forwards"] = min(best.get("forwards", seconds), seconds)
        importance.SPLIT_REPETITION = False
        try:
            seconds, scores["one call"] = timed(lambda: score("triton"))
        finally:
            importance.SPLIT_REPETITION = True
        best["one call"] = min(best.get("one call", seconds), seconds)
    finite = torch.isfinite(scores["torch"])
    diff = (scores["torch"] - scores["triton"]).abs()[finite]
    rel = (diff / scores["torch"][finite].abs().clamp_min(1e-12)).max()
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    print(f"{name}, {args.tokens} tokens, chunk {chunk}, {model.config.num_hidden_layers} layers, best of {args.reps}")
    print("| part | seconds |")
    print("|---|---:|")
    print(f"| scoring, read-out by torch | {best['torch']:.3f} |")
    print(f"| scoring, read-out by the Triton kernels | {best['triton']:.3f} |")
    print(f"| the forwards alone (context pass + repetitions) | {best['forwards']:.3f} |")
    print(f"| read-out by torch / by the kernels | {best['torch'] - best['forwards']:.3f} / {best['triton'] - best['forwards']:.3f} |")
    print(f"| scoring, Triton read-out, each repetition's attention one flash call (no split) | {best['one call']:.3f} |")
    print(f"scores: largest difference {float(diff.max()):.3g} absolute, {float(rel):.3g} relative")
    split = scores["triton"][finite]
    gap = (split - scores["one call"][finite]).abs()
    print(f"split against one call: largest difference {float(gap.max()):.3g} absolute, "
          f"{float((gap / split.abs().clamp_min(1e-12)).max()):.3g} relative; same top half of each row's tokens: "
          f"{same_top_half(scores['triton'], scores['one call']):.4f}")


def same_top_half(a: torch.Tensor, b: torch.Tensor) -> float:
    """The share of each [layer, row, head]'s top half of tokens by ``a`` that is in the top half by ``b`` (KVzip keeps
    ~half of them: what a difference in the scores would change)."""
    keep = a.shape[-1] // 2
    top_a = torch.zeros_like(a, dtype=torch.bool).scatter_(-1, a.topk(keep, -1).indices, True)
    top_b = torch.zeros_like(b, dtype=torch.bool).scatter_(-1, b.topk(keep, -1).indices, True)
    return float((top_a & top_b).sum() / top_a.sum())


if __name__ == "__main__":
    main()
