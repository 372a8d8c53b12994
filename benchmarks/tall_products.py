"""depthweave-kv's prompt products over a long block, with the token axis summed in chunks and in one product.

    python benchmarks/tall_products.py [--tokens 32640] [--chunks 0,512,1024,2048,4096] [--reps 5]

One window's block of Llama-3-8B's shape (4 layers, B = 1, 8 KV heads, ``--tokens`` tokens, head_dim 128; synthetic:
rank 24 shared across the layers plus noise, bfloat16 like a model's keys), on a CUDA GPU. For each chunk length of
:func:`kvweave.core.linalg.tall_product` (0: one product over the whole axis, what cuBLAS did before), best of
``--reps``:

- the sketch basis's first state (``sketch-ema``'s ``init_state``: a randomized range finder, 3 products over the
  block's tokens and 3 Cholesky QRs of tall matrices);
- the residual basis fit (``begin_residual_fit(...).basis()``: the block's second moment, then a subspace iteration);
- the probe's keys and values measurements of the block (``attention-output``, the values' measurement from the keys'
  shared products).

Each setting's results against the first one's (chunk 0 by default): the largest principal angle between the bases
(degrees) and the largest change of the probe's errors. The chunks change only the order of float32 sums.
"""

from __future__ import annotations

import argparse
import time

import torch

from kvweave.core import linalg
from kvweave.engine.residuals import begin_residual_fit
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis
from kvweave.plugins.probes.attention_output import AttentionOutputProbe

LAYERS, BATCH, HEADS, DIM, QUERY_HEADS, OBSERVED = 4, 1, 8, 128, 32, 8


def block_case(tokens: int, device: str = "cuda", seed: int = 0) -> dict:
    """One window's synthetic block [G, B, H, n, D] (float32 of bfloat16 values), its query rows, a perturbed copy of
    each kind and a context of 96 tokens."""
    torch.manual_seed(seed)
    factors = torch.randn(BATCH, HEADS, tokens, 24, device=device)
    mixing = torch.randn(LAYERS, 1, HEADS, 24, DIM, device=device)
    block = torch.einsum("bhnk,gxhkd->gbhnd", factors, mixing)
    block = (block + 0.3 * torch.randn(LAYERS, BATCH, HEADS, tokens, DIM, device=device)).to(torch.bfloat16)
    work = block.float()
    return {
        "work": work,
        "queries": torch.randn(LAYERS, BATCH, QUERY_HEADS, OBSERVED, DIM, device=device),
        "approx_keys": work + 0.05 * torch.randn_like(work),
        "approx_values": work + 0.05 * torch.randn_like(work),
        "context": (work[..., -96:, :].contiguous(), work[..., -96:, :].contiguous()),
    }


def timed(fn, reps: int) -> tuple[float, object]:
    """Best wall time of ``reps`` calls (ms, the GPU synchronized around each) and the last call's result."""
    result = fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best * 1e3, result


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest principal angle (degrees) between the row spaces of bases ``a`` and ``b`` [..., r, C], from its
    sine (what of ``b`` lies outside ``a``'s span), which float32 bases resolve far below the arccos of a cosine."""
    qa = torch.linalg.qr(a.double().transpose(-1, -2))[0].transpose(-1, -2)
    qb = torch.linalg.qr(b.double().transpose(-1, -2))[0].transpose(-1, -2)
    outside = qb - (qb @ qa.transpose(-1, -2)) @ qa
    return torch.rad2deg(torch.arcsin(torch.linalg.matrix_norm(outside, ord=2).max().clamp(max=1.0))).item()


def stages(case: dict, reps: int) -> dict:
    """The three stages timed once each at the current chunk length: times (ms) and results."""
    work = case["work"]
    basis = SketchEmaBasis()
    sketch_ms, state = timed(lambda: basis.init_state(work), reps)
    rows = work - work.mean(-2, keepdim=True)
    fit_ms, fitted = timed(lambda: begin_residual_fit(rows, 8).basis(), reps)
    probe = AttentionOutputProbe()

    def pair():
        shared: dict = {}
        keys = probe.measure_group(case["queries"], work, work, case["approx_keys"], work, *case["context"], None,
                                   shared=shared)
        values = probe.measure_group(case["queries"], work, work, work, case["approx_values"], *case["context"], None,
                                     shared=shared)
        return torch.stack((keys, values))

    probe_ms, errors = timed(pair, reps)
    return {"ms": (sketch_ms, fit_ms, probe_ms), "sketch": state["bases"][:, :, 0].float(), "fit": fitted.float(),
            "errors": errors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32640", help="block lengths, comma-separated")
    parser.add_argument("--chunks", default="0,512,1024,2048,4096", help="chunk lengths (0: one product)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tall_products.py times CUDA products: no CUDA GPU here")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}")
    print("| tokens | chunk | sketch first state (ms) | residual fit (ms) | probe pair (ms) | sketch angle (deg) |"
          " fit angle (deg) | probe error change |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        case = block_case(tokens)
        reference = None
        for chunk in (int(c) for c in args.chunks.split(",")):
            linalg.TALL_CHUNK = chunk
            found = stages(case, args.reps)
            reference = reference or found
            sketch, fit, probe = found["ms"]
            print(f"| {tokens} | {chunk} | {sketch:.2f} | {fit:.2f} | {probe:.2f} | "
                  f"{angle(reference['sketch'], found['sketch']):.2e} | "
                  f"{angle(reference['fit'].flatten(0, -3), found['fit'].flatten(0, -3)):.2e} | "
                  f"{(reference['errors'] - found['errors']).abs().max().item():.2e} |", flush=True)
        del case
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
