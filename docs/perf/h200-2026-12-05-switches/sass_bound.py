"""The ``tiles`` pass (both switches on, 64 tokens a step, one warp) built for sm_90 on a CPU with its registers a
thread unbounded and bounded (``maxnreg`` 128, 112, 104, 96): registers, stack, token-loop instructions and the loop's
local-memory loads and stores (spills).

    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-05-switches/sass_bound.py

The launch is recorded by ../h200-2026-12-04-tiles/sass_tiles.py (``depthweave-kv`` storage, interpreted) and built in
a process without the interpreter."""
import json
import os
import subprocess
import sys

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

job = record("tiles", 64, 1)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for bound in (None, 128, 112, 104, 96):
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps({**job, "maxnreg": bound}), capture_output=True,
                          text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"maxnreg={bound}:", done.stdout.strip().splitlines()[-1], flush=True)
