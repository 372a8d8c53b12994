"""How far the compiled lowbit kernels are from their float32 torch twin at real size, and how far bfloat16 rounding
of the query alone moves the twin (the yardstick ``tests/test_lowbit_gpu.py`` bounds the kernels by).

    python benchmarks/lowbit_twin_error.py [--tokens 32768] [--storages k4v2,qa35v3]

The storages and shapes are ``benchmarks/lowbit_kernel.py``'s (Llama-3-8B attention shape, 2 rows). Needs a CUDA GPU:
on the CPU the kernels run in Triton's interpreter in float32, which says nothing about the GPU build's rounding.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

#: (variant, tokens a step) read at real size
CONFIGS = (("wide", 32), ("general", 16), ("auto", None))


def twin_errors(storage: str, tokens: int = 32768, device: str = "cuda") -> list[dict]:
    """Per variant: the largest and mean absolute difference from the twin, the twin's largest |output| (``scale``)
    and mean |output|, and ``noise``: the largest change of the twin when the query is rounded to bfloat16."""
    from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode

    view = packed_view(2, tokens, device=device, storage=storage)
    q = torch.randn(2, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(device)
    twin = torch_lowbit_decode(view, q, None, HEAD_DIM ** -0.5)
    noise = float((torch_lowbit_decode(view, q.bfloat16().float(), None, HEAD_DIM ** -0.5) - twin).abs().max())
    rows = []
    for variant, block in CONFIGS:
        difference = (lowbit_decode(view, q, None, HEAD_DIM ** -0.5, block=block, variant=variant) - twin).abs()
        rows.append({"storage": storage, "variant": variant, "block": block, "worst": float(difference.max()),
                     "mean": float(difference.mean()), "scale": float(twin.abs().max()),
                     "mean_output": float(twin.abs().mean()), "noise": noise})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--storages", default="k4v2,qa35v3")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("lowbit_twin_error.py measures the GPU build of the kernels: it needs CUDA")
    print("| storage | variant | step | largest difference | mean difference | largest output | mean output | query rounded to bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for storage in args.storages.split(","):
        for r in twin_errors(storage, args.tokens):
            print(f"| {r['storage']} | {r['variant']} | {r['block'] or 'default'} | {r['worst']:.3e} | {r['mean']:.3e} | "
                  f"{r['scale']:.3e} | {r['mean_output']:.3e} | {r['noise']:.3e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
