"""The dense kernel's token loop as built for sm_90 (no GPU) over 4-bit keys stored after RoPE in token groups of
``GROUP`` (2-bit log8 values in tiles, half the tokens kept, one batch row: the launch model.generate makes there): its
instructions, its registers, and the instructions each forward branch in it skips. With KVWEAVE_DENSE_FOLD=1 and a
group of 128 the fold of a group's scales is one of them (docs/kernels.md "What a step of the dense kernel issues").
The switch was removed once timed (no faster); its counts are those of commit 9aa4e53, where it still builds.

    PYTHONPATH=<Triton 3.6.0 installed with pip --target> KVWEAVE_DENSE_FOLD=0|1 \\
        python docs/perf/gpu-2026-12-07-floor/fold_sass.py GROUP
"""
import importlib
import os
import re
import sys

os.environ.pop("TRITON_INTERPRET", None)  # built for the GPU, not run in the interpreter
sys.path.insert(0, "benchmarks")
import attrs  # noqa: E402
import torch  # noqa: E402
import lowbit_kernel  # noqa: E402

from kvweave.kernels.gpu_build import build, launch_job, resources, sass_listing, token_loop  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_launch  # noqa: E402
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer  # noqa: E402
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer  # noqa: E402

group = int(sys.argv[1])
lowbit_kernel.STORAGES["grouped"] = (lambda: ChannelGroupQuantizer(bits=4, group=group, outliers=0),
                                     lambda: RotatedTokenQuantizer(bits=2, scale_format="log8", token_tiles=64), 0.5)
view = attrs.evolve(lowbit_kernel.packed_view(1, 1024, device="cpu", storage="grouped"), k_group=group, inv_freq=None)
q = torch.randn(1, lowbit_kernel.Q_HEADS, lowbit_kernel.HEAD_DIM)
launch = plan_launch(view, q, None, lowbit_kernel.HEAD_DIM ** -0.5, variant="dense", lowp=True)
job = launch_job(launch.kernel, launch.args, launch.constants)
cubin = build(importlib.import_module(job["module"]), job).asm["cubin"]
code, labels = sass_listing(cubin)
lo, hi = token_loop(code, labels)
body = [(address, op, rest) for address, op, _, rest in code if lo <= address <= hi]
print(f"key group {group}, KVWEAVE_DENSE_FOLD={os.environ.get('KVWEAVE_DENSE_FOLD', '0')}: token loop {len(body)} "
      f"instructions, {resources(cubin)}")
for address, op, rest in body:
    target = re.search(r"(\.L_x_\d+)", rest) if op == "BRA" else None
    if target and labels.get(target.group(1), -1) > address:
        skipped = sum(1 for other, _, _ in body if address < other < labels[target.group(1)])
        print(f"  a forward branch at {address:#x} skips {skipped} instructions")
