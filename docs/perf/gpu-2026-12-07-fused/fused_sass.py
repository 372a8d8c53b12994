"""The dense kernel as built for sm_90 (no GPU) with the combine folded into its launch (``FUSE``) and without:
registers, stack bytes, instructions in all and in the token loop (the loop with tensor-core products) and its
local loads, for the launch ``benchmarks/lowbit_kernel.py``'s
storage makes at ``ROWS`` batch rows (the launch's registers: 128 at one wave, 96 past it).

    PYTHONPATH=<Triton 3.6.0 installed with pip --target> python docs/perf/gpu-2026-12-07-fused/fused_sass.py ROWS [STORAGE]

(the fused build at 1b530a5, where the fused combine exists; it was removed after its lease timed it slower, and on
later trees the script counts the two launches' build alone)
"""
import importlib
import sys
from pathlib import Path

import attrs
import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402
import collections  # noqa: E402

from kvweave.kernels.gpu_build import branches, build, launch_job, resources, sass_listing, sass_opcodes  # noqa: E402
from kvweave.kernels.lowbit_combine import plan_combine  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_launch  # noqa: E402

rows, storage = int(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "k4v2e48t")
view = attrs.evolve(packed_view(rows, 32768, device="cpu", storage=storage), inv_freq=None)
q = torch.randn(rows, Q_HEADS, HEAD_DIM)
packed = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant="dense", lowp=True, programs=None)
try:  # at 1b530a5; removed since, where the two launches' build alone is counted
    from kvweave.kernels.lowbit_combine import fused_combine
except ImportError:
    fused = None
else:
    fused = fused_combine(view, packed, plan_combine(view, q, None, HEAD_DIM ** -0.5, packed))
print(f"Triton {triton.__version__}, sm_90, {storage}, B = {rows}: grid {packed.grid}, "
      f"{packed.constants.get('maxnreg')} registers asked, PDL {packed.constants['PDL']}")
for name, launch in (("two launches", packed), ("fused", fused)):
    if launch is None:
        print(f"{name}: not in this tree")
        continue
    job = launch_job(launch.kernel, launch.args, launch.constants)
    cubin = build(importlib.import_module(job["module"]), job).asm["cubin"]
    used = resources(cubin)
    code, labels = sass_listing(cubin)
    spans = [(to, at) for at, to, _ in branches(code, labels) if to < at]
    inner = [span for span in spans if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in spans)]
    loops = [collections.Counter(op for address, op, _, _ in code if lo <= address <= hi) for lo, hi in inner]
    steps = [ops for ops in loops if ops["HMMA"] or ops["HGMMA"]][0]  # the token loop: the one with products
    print(f"{name}: {used['registers']} registers, {used['stack']} stack bytes, {sum(sass_opcodes(cubin).values())} "
          f"instructions, {sum(steps.values())} in the token loop ({steps['LDL']} local loads)")
