"""KVzip's context scoring (``kvweave.engine.importance.reconstruction_scores``) on the Llama-3-8B shape with random
bf16 weights: where its time goes, and how its scores compare with the model's own sdpa attention.

    python benchmarks/scoring_check.py profile [--tokens 32768] [--layers 32] [--smoke]
    python benchmarks/scoring_check.py agreement [--tokens 6000] [--layers 4] [--batch 2] [--sharpen 8] [--smoke]

``profile``: the scoring timed once (after a warm-up on 4,096 tokens), then run under ``torch.profiler``: the 25
operations with the most device time (CPU time with ``--smoke``). ``agreement``: the scores of the scoring path (its
attention for the repetition forwards, read out by the Triton kernels on a GPU) against those of the same scoring run with the model's
sdpa and its mask and the probabilities formed whole in float32; queries and keys scaled by ``--sharpen`` so that attention is sharp. Printed: the
largest and median relative difference, and the share of the top half of each layer's tokens (layers after the first,
whose inputs pass through attention) that both pick.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch

import decode_e2e as e2e
from kvweave.engine import importance
from kvweave.kernels import scoring


@contextlib.contextmanager
def model_sdpa(model):
    """The model's own sdpa with its mask, for the duration (what scoring ran with before its own attention)."""
    previous = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def profile(model, ids, tokenizer, device: str) -> None:
    importance.reconstruction_scores(model, tokenizer, ids[:, :4096])
    e2e.sync()
    start = time.perf_counter()
    importance.reconstruction_scores(model, tokenizer, ids)
    e2e.sync()
    print(f"scoring {ids.shape[-1]:,} tokens: {time.perf_counter() - start:.3f} s")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        importance.reconstruction_scores(model, tokenizer, ids)
        e2e.sync()
    key = "cuda_time_total" if device == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=70))


def agreement(model, ids, tokenizer) -> None:
    new = importance.reconstruction_scores(model, tokenizer, ids)
    own, half = importance.scoring_attention, scoring.exact_half_products
    importance.scoring_attention, scoring.exact_half_products = model_sdpa, lambda keys: contextlib.nullcontext()
    try:  # the model's own attention, the probabilities formed whole in float32 (no TF32)
        old = importance.reconstruction_scores(model, tokenizer, ids, backend="torch")
    finally:
        importance.scoring_attention, scoring.exact_half_products = own, half
    finite = torch.isfinite(old)
    rel = (new - old).abs()[finite] / old[finite].abs().clamp_min(1e-6)
    k = old[1:].numel() // 2
    same = len(set(old[1:].flatten().topk(k).indices.tolist()) & set(new[1:].flatten().topk(k).indices.tolist())) / k
    print(f"scores {tuple(old.shape)}: relative difference largest {float(rel.max()):.3g}, median {float(rel.median()):.3g}; "
          f"top half picked by both (layers 1-): {same:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("profile", "agreement"))
    parser.add_argument("--tokens", type=int)
    parser.add_argument("--layers", type=int)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--sharpen", type=float, default=8.0)
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same head shape on the CPU (checks the script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    profiling = args.mode == "profile"
    layers = args.layers or (32 if profiling else 4)
    tokens = args.tokens or (32768 if profiling else 6000)
    model = e2e.random_model(e2e.smoke_config(layers) if args.smoke else e2e.llama3_8b(layers), device)
    tokenizer = e2e.Ids(model.config.vocab_size)
    ids = torch.randint(0, model.config.vocab_size, (1 if profiling else args.batch, tokens), device=device)
    if profiling:
        profile(model, ids, tokenizer, device)
        return
    for layer in model.model.layers:  # sharper attention than a random model's
        layer.self_attn.q_proj.weight.data *= args.sharpen
        layer.self_attn.k_proj.weight.data *= args.sharpen
    agreement(model, ids, tokenizer)


if __name__ == "__main__":
    main()
