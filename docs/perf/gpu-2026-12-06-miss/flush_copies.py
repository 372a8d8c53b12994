"""Device time of a prompt flush's remaining copies and products at depthweave-kv's sizes (a basis group of 4 layers,
8 KV heads, 32K tokens, 128 channels; the window's tokens as the model hands them, token-major [B, H, n, D] views):
the group's block stacked (torch.stack, or a copy a layer into one buffer), the values' float32 copy, each vector's
largest magnitude (the finite check), and the residual fit's second moment (float32 products, or two bfloat16 halves
of each float32 value multiplied on tensor cores: ``hi^T hi + lo^T hi + hi^T lo``, with its error against float64).
CUDA events around 20 calls, the median of 5 repeats. GPU only.
Run from the repository's root: python docs/perf/gpu-2026-12-06-miss/flush_copies.py [--tokens 32768]"""

from __future__ import annotations

import argparse

import torch

from kvweave.core.linalg import tall_product

from miss_ops import timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("flush_copies.py: no CUDA GPU")
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens, dim, heads, count = args.tokens, 128, 8, args.tokens - 64
    # token-major, as k_proj(x).view(B, n, H, D).transpose(1, 2) leaves them; the flush reads the first count tokens
    parts = [torch.randn(1, tokens, heads, dim, device="cuda", generator=gen).to(torch.bfloat16).transpose(1, 2)[..., :count, :]
             for _ in range(4)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; 4 parts of {tuple(parts[0].shape)} bfloat16, strides {parts[0].stride()}")
    print("| step | way | us a call |")
    print("|---|---|---:|")

    def stack():
        return torch.stack(parts)

    def copies():
        out = torch.empty((4, *parts[0].shape), dtype=parts[0].dtype, device="cuda")
        for g, part in enumerate(parts):
            out[g].copy_(part)
        return out

    def to_float():
        out = torch.empty((4, *parts[0].shape), dtype=torch.float32, device="cuda")
        for g, part in enumerate(parts):
            out[g].copy_(part)
        return out

    block = stack()

    def to_float_stacked():
        return block.float()

    assert torch.equal(stack(), copies())
    for name, fn in (("stack the group's block", stack), ("a copy a layer into one buffer", copies),
                     ("values in float32, a copy a layer", to_float), ("float32 copy of the stacked block", to_float_stacked)):
        print(f"| block | {name} | {timed(fn):.1f} |")
    for name, fn in (("vector_norm(inf)", lambda: [torch.linalg.vector_norm(p, float("inf"), dim=-1) for p in parts]),
                     ("abs().amax()", lambda: [p.abs().amax(-1) for p in parts]),
                     ("amax and amin", lambda: [torch.maximum(p.amax(-1), -p.amin(-1)) for p in parts])):
        print(f"| largest magnitudes of 4 layers | {name} | {timed(fn):.1f} |")

    rows = (block.float() - block.float().roll(1, -2) * 0.9)  # misses-like float32 rows [4, 1, 8, n, 128]
    exact = torch.stack([tall_product(r.double(), r.double()) for r in rows])

    def moment_f32():
        return torch.stack([tall_product(r, r) for r in rows])

    def moment_halves():
        hi = rows.to(torch.bfloat16)
        lo = (rows - hi.float()).to(torch.bfloat16)
        both = torch.cat((hi, lo), dim=-1)  # [..., n, 2D]
        out = []
        for g in range(rows.shape[0]):
            p = tall_product(both[g], hi[g])  # [..., 2D, D]: hi^T hi over lo^T hi
            out.append(p[..., :dim, :] + p[..., dim:, :] + p[..., dim:, :].transpose(-1, -2))
        return torch.stack(out)

    def halves_product_only(both=None, hi=None):
        return [tall_product(both_g, hi_g) for both_g, hi_g in zip(both, hi)]

    def moment_all_halves():
        hi = rows.to(torch.bfloat16)
        both = torch.cat((hi, (rows - hi.float()).to(torch.bfloat16)), dim=-1)
        out = []
        for g in range(rows.shape[0]):
            p = tall_product(both[g], both[g])  # [..., 2D, 2D]: the four products of the halves
            out.append(p[..., :dim, :dim] + p[..., dim:, :dim] + p[..., :dim, dim:] + p[..., dim:, dim:])
        return torch.stack(out)

    hi = rows.to(torch.bfloat16)
    both = torch.cat((hi, (rows - hi.float()).to(torch.bfloat16)), dim=-1)
    for name, fn in (("float32 products", moment_f32), ("bfloat16 halves, split here", moment_halves),
                     ("bfloat16 halves, the products alone", lambda: halves_product_only(both, hi)),
                     ("bfloat16 halves and lo^T lo, split here", moment_all_halves),
                     ("bfloat16 halves and lo^T lo, the products alone", lambda: halves_product_only(both, both))):
        us = timed(fn)
        err = ""
        if "alone" not in name:
            got = fn().double()
            err = f" (largest error {float((got - exact).abs().amax() / exact.abs().amax()):.2e} of the largest entry)"
        print(f"| residual second moment | {name}{err} | {us:.1f} |")


if __name__ == "__main__":
    main()
