"""The ``tiles`` pass built for sm_90 with each setting of ``BYTES`` (int8 coefficients made float16 by byte permutes)
and ``ROWS`` (value coefficients loaded token-major): registers a thread, stack, and the token loop's instructions
(each once), on the installed Triton (run where the GPU's Triton is installed to count what it builds).

    python docs/perf/gpu-2026-12-06-bytes/sass_bytes.py

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
top = {op: loop.get(op, 0) for op in ("I2F", "PRMT", "LOP3", "HADD2", "LDS", "STS", "LDSM", "BAR", "HMMA")}
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()), **top}))
"""

print("triton", triton.__version__)
job = record("tiles", 64, 1)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for bytes_, rows in ((False, False), (True, False), (False, True), (True, True)):
    job["constants"].update(BYTES=bytes_, ROWS=rows)
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"bytes={bytes_} rows={rows}:", done.stdout.strip().splitlines()[-1], flush=True)
