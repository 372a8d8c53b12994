"""What the packed pass's masks cost the ``lowbit`` kernel: the device time of the packed kernel alone (the combine
apart) over one storage, launched plain, with each row's first visible position, with a list of 4 hidden slots a row,
with both, with one slot of the list real, and with the hidden slots given as a first visible position
(``LowbitView.hidden_below``, how the sinks reach it since 2026-12-03).

    python benchmarks/hidden_slots.py [--storage k4v2e48] [--batch 128] [--tokens 65536] [--reps 10]

Storages as ``benchmarks/lowbit_kernel.py`` packs them, keys read as stored after RoPE (the ``dense`` kernel's), Llama-3-8B
attention shape. The rows of the list name no slot (-1) except in "hidden-real" (slot 0 of every row), so every case
attends the same tokens but that one: the times differ by what the masks cost. A table on stdout.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import attrs
import torch
from torch.profiler import ProfilerActivity, profile

from kvweave.kernels.lowbit_decode import lowbit_decode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_kernel import HEAD_DIM, KV_HEADS, Q_HEADS, STORAGES, packed_view  # noqa: E402


def packed_us(view, q, start, reps: int) -> float:
    """Device time of the packed pass's kernel a call (the launch's largest kernel: not the combine), us."""
    for _ in range(3):
        lowbit_decode(view, q, start, HEAD_DIM ** -0.5, programs=4 * q.shape[0] * KV_HEADS)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            lowbit_decode(view, q, start, HEAD_DIM ** -0.5, programs=4 * q.shape[0] * KV_HEADS)
        torch.cuda.synchronize()
    times = [getattr(e, "self_device_time_total", 0) for e in prof.key_averages() if "combine" not in e.key]
    return max(times) / reps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="k4v2e48", choices=list(STORAGES))
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=65536)
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("hidden_slots.py times CUDA kernels; run it on a GPU machine")
    batch = args.batch
    view = attrs.evolve(packed_view(batch, args.tokens, storage=args.storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    start = torch.zeros(batch, dtype=torch.int32, device="cuda")
    none = torch.full((batch * KV_HEADS, 4), -1, dtype=torch.int32, device="cuda")
    real = none.clone()
    real[:, 0] = 0
    cases = {
        "plain": (view, None),
        "first position": (view, start),
        "hidden list": (attrs.evolve(view, hidden_slots=none), None),
        "both": (attrs.evolve(view, hidden_slots=none), start),
        "hidden list, one real": (attrs.evolve(view, hidden_slots=real), None),
        "hidden as first position": (attrs.evolve(view, hidden_slots=none, hidden_below=start), None),
    }
    print(f"{torch.cuda.get_device_name()}, storage {args.storage}, B = {batch}, T = {args.tokens}")
    print("\n| launch | packed kernel (us) | against plain |\n|---|---:|---:|")
    plain = None
    for name, (v, s) in cases.items():
        us = packed_us(v, q, s, args.reps)
        plain = plain or us
        print(f"| {name} | {us:,.1f} | {us / plain:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
