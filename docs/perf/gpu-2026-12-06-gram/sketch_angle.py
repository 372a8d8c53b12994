"""How near the sketch's bases come to the exact top-16 subspace of a 32K-token block, by path: the rows' Gram matrix
from the 16-bit block (sketch-ema's path on a GPU), from its float32 copy, and the range finder on the float32 rows
(the path before), at several chunk lengths of the 16-bit Gram matrix; with each path's time. The exact subspace: the
top eigenvectors of the float64 Gram matrix. Synthetic block of benchmarks/tall_products.py (bfloat16 values, rank 24
plus noise, 4 layers x 8 KV heads x 128 channels, token-factor rows of 512 channels). GPU only.
Run from the repository's root: python docs/perf/gpu-2026-12-06-gram/sketch_angle.py [--tokens 32768]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from kvweave.core import linalg
from kvweave.plugins.bases._sketch import randomized_top_right
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
import tall_products  # noqa: E402


def energy(rows: torch.Tensor, basis: torch.Tensor) -> float:
    """The share of the rows' energy the basis [B, H, r, C] keeps (orthonormalized first)."""
    q = torch.linalg.qr(basis.double().transpose(-1, -2))[0]
    return float((rows.double() @ q).pow(2).sum() / rows.double().pow(2).sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("sketch_angle.py: no CUDA GPU")
    work = tall_products.block_case(args.tokens)["work"]
    block = work.to(torch.bfloat16)
    basis = SketchEmaBasis(window=4, rank=16)
    rows = basis._rows(work)
    gram = linalg.tall_product(rows.double(), rows.double(), 0)
    truth = torch.linalg.eigh(gram.cpu())[1].flip(-1)[..., :16].transpose(-1, -2).cuda()
    print(f"| path | largest angle to the exact subspace (degrees) | energy kept | energy of the exact subspace | ms |")
    print("|---|---:|---:|---:|---:|")
    best = energy(rows, truth)
    cases = [(f"Gram of the bfloat16 block, chunks of {c or args.tokens}", c, block) for c in (1024, 4096, 0)]
    cases += [("Gram of the float32 copy", 1024, work)]
    for name, chunk, x in cases:
        linalg.TALL_CHUNK = chunk
        ms, state = tall_products.timed(lambda: basis.init_state(x), 5)
        p = state["bases"][:, :, 0]
        print(f"| {name} | {tall_products.angle(truth, p.float()):.4f} | {energy(rows, p):.6f} | {best:.6f} | {ms:.2f} |")
    linalg.TALL_CHUNK = 1024
    ms, (p, _) = tall_products.timed(lambda: randomized_top_right(basis._rows(work, scaled=True), 16, 8, 2, 0), 5)
    print(f"| range finder on the float32 rows (before) | {tall_products.angle(truth, p):.4f} | {energy(rows, p.half()):.6f} "
          f"| {best:.6f} | {ms:.2f} |")


if __name__ == "__main__":
    main()
