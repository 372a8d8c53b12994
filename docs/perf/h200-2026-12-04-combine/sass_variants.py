"""The dense kernel's sm_90 token loop, built on a CPU (no GPU needed) under launch settings the launch does not take by
itself: warps a program, the register cap, and the 4-bit offset taken out or not. Run from the repository's root, with
the Triton of the GPU machine for its counts (``PYTHONPATH=/path/to/triton-3.6``):

    python docs/perf/h200-2026-12-04-combine/sass_variants.py STORAGE WARPS:REGISTERS[:OFFSET_OUT] ...

e.g. ``k4v4e77t 4:96:0 4:96:1`` (the offset taken out: 0 no, 1 yes), ``k4v2e48t 4:96 2:0 1:0`` (0 registers: no cap).
Prints each build's loop instructions, registers, stack bytes and the loop's barriers, shared-memory and tensor-core
instructions (``kvweave.kernels.gpu_build``, as ``benchmarks/kernel_sass.py`` counts them)."""

import collections
import importlib
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, "benchmarks")

import attrs  # noqa: E402
import torch  # noqa: E402

from kvweave.kernels import lowbit_dense  # noqa: E402
from kvweave.kernels.gpu_build import build, launch_job, resources, sass_opcodes  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_launch  # noqa: E402
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

storage = sys.argv[1]
for spec in sys.argv[2:]:
    warps, registers, *rest = (int(part) for part in spec.split(":"))
    lowbit_dense.DENSE_OFFSET_OUT = bool(rest[0]) if rest else True
    view = attrs.evolve(packed_view(1, 256, device="cpu", storage=storage), inv_freq=None)
    launch = plan_launch(view, torch.randn(1, Q_HEADS, HEAD_DIM), None, HEAD_DIM ** -0.5, variant="dense", lowp=True,
                         num_warps=warps)
    constants = {**launch.constants, "num_warps": warps}
    constants.pop("maxnreg", None)
    if registers:
        constants["maxnreg"] = registers
    job = launch_job(launch.kernel, launch.args, constants)
    cubin = build(importlib.import_module(job["module"]), job, arch=90).asm["cubin"]
    loop = collections.Counter(sass_opcodes(cubin, loop=True))
    print(spec, "LEVELS", constants["LEVELS"], "loop", sum(loop.values()), resources(cubin),
          {name: loop.get(name, 0) for name in ("BAR", "STS", "LDS", "LDSM", "HMMA", "HFMA2")}, flush=True)
