"""The dense kernel at head_dim 256 under register caps (``kvweave.kernels.lowbit_dense.DENSE_WIDE_REGISTERS``, set in
turn; the launch's splits follow the programs an SM each cap allows), graph time of 10 calls replayed from a CUDA
graph, against SDPA over the full bf16 cache: one table row per storage, T and B.

    python docs/perf/gpu-2026-12-06-d256/ab_registers.py [CAPS, default 96,112,128,160,0 (0: the compiler's choice)]
"""
import sys
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from decode_kernel import graph_us  # noqa: E402
from lowbit_kernel import SHAPES, WINDOW, packed_view  # noqa: E402

from kvweave.kernels import lowbit_dense  # noqa: E402
from kvweave.kernels.lowbit_decode import lowbit_decode  # noqa: E402

caps = [int(c) for c in (sys.argv[1] if len(sys.argv) > 1 else "96,112,128,160,0").split(",")]
q_heads, kv_heads, dim, _ = SHAPES["d256"]
print(f"{torch.cuda.get_device_name()}; caps {caps}")
print("| storage | T | B | SDPA us | " + " | ".join(f"cap {c or 'none'}" for c in caps) + " |")
print("|---|---:|---:|---:|" + "---:|" * len(caps))
for storage in ("k4v2e48t", "k4v4e77t"):
    for tokens, batch in ((131072, 8), (32768, 1), (131072, 32), (131072, 1), (32768, 8)):
        view = attrs.evolve(packed_view(batch, tokens, storage=storage, shape="d256"), inv_freq=None)
        q = torch.randn(batch, q_heads, dim, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(batch, kv_heads, tokens + WINDOW, dim, device="cuda", dtype=torch.bfloat16)
        values = torch.randn_like(keys)
        sdpa = graph_us(lambda: F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True), 10)
        cells = []
        for cap in caps:
            lowbit_dense.DENSE_WIDE_REGISTERS = cap or None
            us = graph_us(lambda: lowbit_decode(view, q, None, dim ** -0.5, variant="auto", programs=None), 10)
            cells.append(f"{us:.1f} ({sdpa / us:.2f}x)")
        print(f"| {storage} | {tokens} | {batch} | {sdpa:.1f} | " + " | ".join(cells) + " |", flush=True)
        del view, keys, values
        torch.cuda.empty_cache()
