"""Device time by kernel of a 32K prompt block's residual stages (depthweave-kv's sizes: 4 layers x 8 KV heads x 128
channels, residual basis of 8, a quarter of the tokens given rank 8): ``encode_residuals`` and the residual fit's
second moment, each kernel with the kvweave line that launched it. GPU only.
Run from the repository's root: python docs/perf/gpu-2026-12-06-gram/residual_ops.py [--tokens 32768]"""

from __future__ import annotations

import argparse

import torch

from kvweave.core.linalg import tall_product
from kvweave.engine.residuals import encode_residuals
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("residual_ops.py: no CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, tokens, dim, rank = 4 * 8, args.tokens, 128, 8
    missing = torch.randn(rows, 1, tokens, dim, device="cuda", generator=gen)
    ranks = torch.where(torch.rand(rows, 1, tokens, device="cuda", generator=gen) < 0.25, rank, 0)
    count = int((ranks == rank).sum())
    basis = torch.linalg.qr(torch.randn(rows, 1, dim, rank, device="cuda", generator=gen))[0].transpose(-1, -2).half()
    quantizer = Int4GroupQuantizer(group=2)

    def encode():
        encode_residuals(missing, ranks, quantizer, basis, {rank: count}, torch.bfloat16)

    def moment():
        torch.stack([tall_product(part.float(), part.float()) for part in missing.view(4, 8, tokens, dim)])

    for name, fn in (("encode_residuals", encode), ("residual moment", moment)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU],
                                    with_stack=True) as prof:
            fn()
            torch.cuda.synchronize()
        print(f"## {name} ({tokens} tokens)")
        print(prof.key_averages(group_by_stack_n=4).table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
