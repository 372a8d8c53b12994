"""The fused kernel's launch settings, swept on one cache: tokens per loop iteration, warps per program and
tokens per program (the split).

    python benchmarks/kernel_tuning.py [--tokens 131072] [--batch 8] [--blocks 32,64,128] [--warps 1,2,4]
                                       [--splits 0,512,1024,2048] [--stages 0] [--variant tiles]

Storage as in ``decode_kernel.py`` (Llama-3-8B attention shape, ``depthweave-kv``'s settings). For every
combination: the kernel's device time (torch profiler, mean of ``--reps`` calls), the programs launched,
and the largest difference from the torch twin (every setting computes the same attention). Split 0 is
the cache's own split (``choose_split``); stages 0 is Triton's default pipelining depth (3);
kvweave's default is 1. ``--variant``: the packed-token pass (``tiles``, which steps over 32 or 64 tokens, or
``gather``).
"""

from __future__ import annotations

import argparse
import datetime
import itertools

import torch

from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import load_pipeline
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.decode_view import resplit
from kvweave.kernels.depthweave_decode import fused_decode

from decode_kernel import HEAD_DIM, KV_HEADS, Q_HEADS, device_us, llama3_window_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--blocks", default="32,64,128")
    parser.add_argument("--warps", default="1,2,4")
    parser.add_argument("--splits", default="0,512,1024,2048")
    parser.add_argument("--stages", default="0", help="software-pipelining depths (num_stages) to try; 0: Triton's default (3); kvweave launches 1")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--pipeline", default="depthweave-kv")
    parser.add_argument("--variant", default="tiles", help="the packed-token pass: tiles or gather")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("kernel_tuning.py times CUDA kernels; run it on a GPU machine")
    cache = KVWeaveCache(load_pipeline(args.pipeline), llama3_window_config())
    fill_cache(cache, args.batch, args.tokens, chunk=8192, device="cuda", seed=args.tokens)
    engine = cache.engine
    view = engine.kernel.decode_view(engine.view(1), torch.device("cuda"))
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
    scale = HEAD_DIM**-0.5
    twin = torch_decode(view, q, None, scale).float()
    print(f"# fused kernel settings, {args.variant} pass, T = {view.packed_tokens} packed tokens, B = {args.batch}, {datetime.date.today()} "
          f"{torch.cuda.get_device_name()}")
    print("| tokens/iteration | warps | stages | tokens/program | programs | device time (us) | max |diff| vs twin |")
    print("|---|---|---|---|---|---|---|")
    best = None
    for block, warps, stages, split in itertools.product(
        [int(x) for x in args.blocks.split(",")], [int(x) for x in args.warps.split(",")],
        [int(x) for x in args.stages.split(",")], [int(x) for x in args.splits.split(",")],
    ):
        chosen = split or None
        segments = view.segments if chosen is None else resplit(view.segments, chosen)
        run = lambda: fused_decode(view, q, None, scale, split=chosen, block_tokens=block, num_warps=warps, num_stages=stages or None, variant=args.variant)  # noqa: E731
        try:
            us = device_us(run, args.reps)
        except Exception as exc:  # a setting the compiler refuses (e.g. out of shared memory)
            print(f"| {block} | {warps} | {stages or 'default'} | {split or 'cache'} | - | failed: {type(exc).__name__} | |")
            continue
        error = (run().float() - twin).abs().max().item()
        programs = segments.shape[0] * args.batch * KV_HEADS
        print(f"| {block} | {warps} | {stages or 'default'} | {split or 'cache'} | {programs} | {us:.1f} | {error:.2e} |", flush=True)
        if best is None or us < best[0]:
            best = (us, block, warps, stages or "default", split or "cache")
    if best is not None:
        print(f"fastest: {best[0]:.1f} us at {best[1]} tokens/iteration, {best[2]} warps, stages {best[3]}, split {best[4]}")


if __name__ == "__main__":
    main()
