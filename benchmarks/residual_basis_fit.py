"""Time fitting a per-layer residual basis to one block: an SVD of the block against the eigendecomposition
of its D x D second moment (what kvweave does), for the prompt-sized blocks that set time to first token.

    python benchmarks/residual_basis_fit.py [--tokens 8192] [--heads 8] [--dim 128] [--device cpu] [--threads 1]

Prints the median of 5 runs of each and the largest angle between the two rank-8 subspaces they find.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvweave.core.residuals import fit_residual_basis


def median_seconds(fn, device: str, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    block = torch.randn(1, args.heads, args.tokens, args.dim, device=args.device)
    svd = median_seconds(lambda: torch.linalg.svd(block, full_matrices=False), args.device)
    eig = median_seconds(lambda: fit_residual_basis(block, args.rank), args.device)
    right = torch.linalg.svd(block, full_matrices=False)[2][..., : args.rank, :]
    basis = fit_residual_basis(block, args.rank).float()
    cosines = torch.linalg.svdvals(right @ basis.transpose(-1, -2)).clamp(max=1.0)
    angle = torch.rad2deg(torch.arccos(cosines.min())).item()
    print(f"block [1, {args.heads}, {args.tokens}, {args.dim}] on {args.device}, {args.threads} thread(s)")
    print(f"SVD of the block            {svd * 1e3:9.1f} ms")
    print(f"eigh of the second moment   {eig * 1e3:9.1f} ms   ({svd / eig:.0f}x faster)")
    print(f"largest angle between the rank-{args.rank} subspaces: {angle:.2f} degrees")


if __name__ == "__main__":
    main()
