"""Device time of two steps of a prompt block's residuals at depthweave-kv's sizes (4 layers x 8 KV heads x 32K tokens x
128 channels, a residual basis of 8): the misses (the block's difference from its reconstruction and each token's
relative miss) by torch's three passes and by the Triton kernel; and a level's entries selected from the coordinates
token-major (index_select of rows of 8 floats, the code before) and rank-major (the code now), the selected values
checked equal. CUDA events around 20 calls, the median of 5 repeats. GPU only.
Run from the repository's root: python docs/perf/gpu-2026-12-06-miss/miss_ops.py [--tokens 32768]"""

from __future__ import annotations

import argparse
import statistics

import torch

from kvweave.kernels.miss import block_miss, block_miss_torch


def timed(fn, calls: int = 20, repeats: int = 5) -> float:
    """Microseconds a call: the median over ``repeats`` of ``calls`` calls between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("miss_ops.py: no CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, dim, rank = args.tokens, 128, 8
    block = (3 * torch.randn(4, 1, 8, tokens, dim, device="cuda", generator=gen)).to(torch.bfloat16)
    approx = block.float() + 0.3 * torch.randn(block.shape, device="cuda", generator=gen)
    moved = (block.numel() * (2 + 4 + 4) + block[..., 0].numel() * 4) / 1e9  # GB the kernel moves
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; a block of {tuple(block.shape)} bfloat16")
    print("| step | way | us a call | GB/s on the kernel's bytes |")
    print("|---|---|---:|---:|")
    for way, fn in (("torch (sub, two norms)", lambda: block_miss_torch(block, approx)), ("kernel", lambda: block_miss(block, approx))):
        us = timed(fn)
        print(f"| misses | {way} | {us:.1f} | {moved / us * 1e6:.0f} |")
    difference, _ = block_miss(block, approx)
    rows = difference.flatten(0, 1)  # as encode_members passes a group: [G x B, H, n, D]
    basis = torch.linalg.qr(torch.randn(rows.shape[0], rows.shape[1], dim, rank, device="cuda", generator=gen))[0].transpose(-1, -2).half()
    coordinates = torch.einsum("bhnd,bhkd->bhnk", rows, basis.float())
    for share, level in ((0.25, 8), (0.75, 4), (1.0, 8)):
        chosen = torch.nonzero(torch.rand(coordinates.shape[:-1], device="cuda", generator=gen).reshape(-1) < share).squeeze(1)
        flat = coordinates.reshape(-1, rank)

        def token_major():
            return flat.index_select(0, chosen)[:, :level]

        def rank_major():
            by_rank = coordinates.permute(3, 0, 1, 2).reshape(rank, -1)
            return by_rank[:level].index_select(1, chosen).t()

        assert torch.equal(token_major(), rank_major())
        for way, fn in (("token-major", token_major), ("rank-major (with its permuted copy)", rank_major)):
            print(f"| select {chosen.numel():,} entries of rank {level} | {way} | {timed(fn):.1f} | |")


if __name__ == "__main__":
    main()
