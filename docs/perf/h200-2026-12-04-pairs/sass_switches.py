"""Registers and token-loop instructions of the ``tiles`` pass built for sm_90 on a CPU, for each setting of its two
switches (``kvweave.kernels.depthweave_decode.TILES_COLUMNS``, ``TILES_AHEAD``), 64 tokens a step, one warp:

    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-04-pairs/sass_switches.py

The launch is recorded by ../h200-2026-12-04-tiles/sass_tiles.py (``depthweave-kv`` storage, interpreted) and built in
a process without the interpreter; besides the loop's size, its shared-memory stores and loads and its barriers."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "h200-2026-12-04-tiles"))
from sass_tiles import record  # noqa: E402

from kvweave.kernels import depthweave_decode  # noqa: E402

BUILD = """
import importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
built = gpu_build.build(importlib.import_module(job["module"]), job)
loop = gpu_build.sass_opcodes(built.asm["cubin"], loop=True)
shared = {op: loop[op] for op in ("STS", "LDS", "LDSM", "BAR")}
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()), **shared}))
"""

env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for columns in (False, True):
    for ahead in (False, True):
        depthweave_decode.TILES_COLUMNS, depthweave_decode.TILES_AHEAD = columns, ahead
        job = record("tiles", 64, 1)
        done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(job), capture_output=True, text=True,
                              env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(f"columns={columns} ahead={ahead}:", done.stdout.strip().splitlines()[-1], flush=True)
