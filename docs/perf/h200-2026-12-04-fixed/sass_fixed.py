"""The dense kernel's sm_90 token loop built on a CPU with the softmax against a fixed reference (FIX) and with a running
maximum: the loop's instructions, those of the first step's reduction (a block the loop's other steps branch past),
what the other steps run, and the loop's barriers and lane shuffles. Run from the repository's root with the GPU
machine's Triton for its counts:

    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-04-fixed/sass_fixed.py k4v2e48t k4v4e77t

``REGISTERS=N`` in the environment builds with a thread's registers capped at N instead of the launch's 96.
"""
import importlib
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks")

import attrs  # noqa: E402
import torch  # noqa: E402
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

from kvweave.kernels import lowbit_dense  # noqa: E402
from kvweave.kernels.gpu_build import branches, build, launch_job, resources, sass_listing, token_loop  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_launch  # noqa: E402




if os.environ.get("REGISTERS"):
    lowbit_dense.DENSE_MAX_REGISTERS = int(os.environ["REGISTERS"])


def dense_cubin(storage):
    """The dense kernel's sm_90 build for ``storage`` (``benchmarks/lowbit_kernel.py``'s) as the launch sets it up."""
    view = attrs.evolve(packed_view(1, 256, device="cpu", storage=storage), inv_freq=None)
    launch = plan_launch(view, torch.randn(1, Q_HEADS, HEAD_DIM), None, HEAD_DIM ** -0.5, variant="dense", lowp=True)
    job = launch_job(launch.kernel, launch.args, launch.constants)
    return build(importlib.import_module(job["module"]), job, arch=90).asm["cubin"]


for storage in sys.argv[1:] if __name__ == "__main__" else ():
    for fixed in (False, True):
        lowbit_dense.DENSE_FIXED_MAX = fixed
        cubin = dense_cubin(storage)
        code, labels = sass_listing(cubin)
        lo, hi = token_loop(code, labels)
        body = [c for c in code if lo <= c[0] <= hi]
        skips = [(at, to) for at, to, guard in branches(code, labels) if lo <= at < to <= hi and guard]
        skipped = [c for c in body if any(at < c[0] < to for at, to in skips)]
        rest = [c for c in body if c not in skipped]
        count = lambda part, op: sum(1 for c in part if c[1] == op)  # noqa: E731
        print(f"{storage} FIX={fixed}: loop {len(body)}, first step's block {len(skipped)}, other steps {len(rest)} "
              f"(BAR {count(rest, 'BAR')}, SHFL {count(rest, 'SHFL')}, FMNMX {count(rest, 'FMNMX')}); {resources(cubin)}",
              flush=True)
