"""The fused decode kernel's GPU time by kernel (torch profiler), on a cache of one batch size.

    python benchmarks/profile_kernel.py [--tokens 131072] [--batch 1] [--pipeline depthweave-kv]

Fills one 4-layer window of Llama-3-8B attention shape (32 query heads, 8 KV heads, d=128) with
synthetic K/V through the engine (the segments are split for this batch size, as a real cache of it
would be), then profiles five calls of the kernel and prints the device time of each launched kernel
(the packed-token pass, the exact-window pass, the combine pass).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import load_pipeline
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels.depthweave_decode import fused_decode

from decode_kernel import HEAD_DIM, Q_HEADS, llama3_window_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=131072)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pipeline", default="depthweave-kv")
    args = parser.parse_args()
    cache = KVWeaveCache(load_pipeline(args.pipeline), llama3_window_config())
    fill_cache(cache, args.batch, args.tokens, chunk=16384, device="cuda", seed=1)
    engine = cache.engine
    view = engine.kernel.decode_view(engine.view(1), torch.device("cuda"))
    q = torch.randn(args.batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        fused_decode(view, q, None, HEAD_DIM**-0.5)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fused_decode(view, q, None, HEAD_DIM**-0.5)
        torch.cuda.synchronize()
    print(f"segments: {view.segments.shape[0]} x {args.batch * 8} rows; packed tokens {view.packed_tokens}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8))


if __name__ == "__main__":
    main()
