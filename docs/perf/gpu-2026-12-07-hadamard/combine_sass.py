"""The ``lowbit`` combine as built for sm_90 (no GPU), its Hadamard rotation undone by the transform and by the
matrix: registers, stack and instructions of the launch ``benchmarks/lowbit_kernel.py``'s 8x storage makes at
``ROWS`` batch rows (1-32 at 8 KV heads: a program a query head; more: a program a KV head) and ``SHAPE`` (llama3-8b or
d256). The transform is counted with ``COMBINE_HADAMARD`` at 1 (the default), the matrix with it at 0.

    PYTHONPATH=<Triton 3.6.0 installed with pip --target> python docs/perf/gpu-2026-12-07-hadamard/combine_sass.py ROWS [SHAPE]
"""
import importlib
import sys
from pathlib import Path

import attrs
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from lowbit_kernel import SHAPES, packed_view  # noqa: E402
from kvweave.kernels import lowbit_combine  # noqa: E402
from kvweave.kernels.gpu_build import build, launch_job, resources, sass_opcodes  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_combine, plan_launch  # noqa: E402

rows, shape = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "llama3-8b")
q_heads, _, dim, _ = SHAPES[shape]
view = attrs.evolve(packed_view(rows, 4096, device="cpu", storage="k4v2e48t", shape=shape), inv_freq=None)
q = torch.randn(rows, q_heads, dim)
print(f"Triton {triton.__version__}, sm_90, {shape}, B = {rows}")
for setting in (1, 0):
    lowbit_combine.COMBINE_HADAMARD = setting
    combine = plan_combine(view, q, None, dim ** -0.5, plan_launch(view, q, None, dim ** -0.5, variant="dense", lowp=True))
    job = launch_job(combine.kernel, combine.args, combine.constants)
    cubin = build(importlib.import_module(job["module"]), job).asm["cubin"]
    used = resources(cubin)
    print(f"{job['kernel']}: {'transform' if combine.constants['HAD'] else 'matrix'} (HAD {combine.constants['HAD']}, "
          f"WHOLE {combine.constants.get('WHOLE', '-')}): {used['registers']} registers, {used['stack']} stack bytes, "
          f"{sum(sass_opcodes(cubin).values())} instructions")
