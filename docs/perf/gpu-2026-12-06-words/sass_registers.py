"""The ``tiles`` decode pass (the codes as words a step ahead, ``WORDS`` = 2, byte permutes) built for sm_90 under caps
on its registers, as ``TILES_REGISTERS`` passes them (``maxnreg``): registers a thread, stack bytes, the token loop's
instructions and its spilled loads and stores (``LDL``, ``STL``). On the installed Triton; a machine without a GPU
builds with Triton's CUDA backend.

    python docs/perf/gpu-2026-12-06-words/sass_registers.py [CAP ...]   (default: none 160 144 128 112)

The launch is recorded by ../h200-2026-12-04-tiles/sass_tiles.py (``depthweave-kv`` storage, interpreted) and built in
a process without the interpreter."""
import json
import os
import subprocess
import sys

import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "h200-2026-12-04-tiles"))
from sass_tiles import record  # noqa: E402

BUILD = """
import importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
built = gpu_build.build(importlib.import_module(job["module"]), job)
loop = gpu_build.sass_opcodes(built.asm["cubin"], loop=True)
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()), "LDL": loop.get("LDL", 0),
                  "STL": loop.get("STL", 0)}))
"""

print("triton", triton.__version__)
job = record("tiles", 64, 1)
job["constants"].update(ASM=True, BYTES=True, ROWS=True, WORDS=2)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for cap in [None if c == "none" else int(c) for c in sys.argv[1:] or ["none", "160", "144", "128", "112"]]:
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps({**job, "maxnreg": cap}), capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"maxnreg={cap}:", done.stdout.strip().splitlines()[-1], flush=True)
