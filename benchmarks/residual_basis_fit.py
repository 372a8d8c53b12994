"""Time fitting a per-layer residual basis to one block, for the prompt-sized blocks that set time to first
token: an SVD of the block, ``eigh`` of its D x D second moment, and ``fit_residual_basis`` (what kvweave
does: ``eigh`` on a CPU, batched subspace iteration on a GPU).

    python benchmarks/residual_basis_fit.py [--tokens 8192] [--heads 8] [--dim 128] [--device cpu] [--threads 1]

Prints the median of 5 runs of each, the largest angle between kvweave's rank-8 subspace and the SVD's,
and the share of the SVD subspace's energy that kvweave's captures (1.0: as good). The block is Gaussian
noise, the hardest case for an iterative method (a flat spectrum).
"""

from __future__ import annotations

import argparse
import time

import torch

from kvweave.engine.residuals import fit_residual_basis


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
    eigh = median_seconds(lambda: torch.linalg.eigh(block.transpose(-1, -2) @ block), args.device)
    fit = median_seconds(lambda: fit_residual_basis(block, args.rank), args.device)
    right = torch.linalg.svd(block, full_matrices=False)[2][..., : args.rank, :]
    basis = fit_residual_basis(block, args.rank).float()
    cosines = torch.linalg.svdvals(right @ basis.transpose(-1, -2)).clamp(max=1.0)
    angle = torch.rad2deg(torch.arccos(cosines.min())).item()
    energy = ((block @ basis.transpose(-1, -2)).norm() ** 2 / (block @ right.transpose(-1, -2)).norm() ** 2).item()
    print(f"block [1, {args.heads}, {args.tokens}, {args.dim}] on {args.device}, {args.threads} thread(s)")
    print(f"SVD of the block            {svd * 1e3:9.1f} ms")
    print(f"eigh of the second moment   {eigh * 1e3:9.1f} ms")
    print(f"fit_residual_basis          {fit * 1e3:9.1f} ms   ({svd / fit:.0f}x faster than the SVD)")
    print(f"largest angle to the SVD's rank-{args.rank} subspace: {angle:.2f} degrees; energy captured {energy:.4f} of the SVD's")


if __name__ == "__main__":
    main()
