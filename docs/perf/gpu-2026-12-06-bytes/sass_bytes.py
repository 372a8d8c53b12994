"""The ``tiles`` pass built for sm_90 with each setting of ``BYTES`` (int8 coefficients made float16 by byte permutes)
and ``ROWS`` (value coefficients loaded token-major): registers a thread, stack, and the token loop's instructions
(each once), on the installed Triton (run where the GPU's Triton is installed to count what it builds).

    python docs/perf/gpu-2026-12-06-bytes/sass_bytes.py [SETTING ...]

A SETTING is the kernel's constants to build with, ``NAME=VALUE`` comma-separated (e.g. ``BYTES=1,ROWS=1,WORDS=2``);
without any, the four settings of ``BYTES`` and ``ROWS`` (run 1). ``ttgir_sha256``: the start of the hash of the
kernel's Triton GPU IR without its source locations; two trees whose builds print the same one build the same kernel.
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
import hashlib, importlib, json, re, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
built = gpu_build.build(importlib.import_module(job["module"]), job)
ttgir = re.sub(r"#loc[^\\n]*\\n|loc\\([^)]*\\)", "", built.asm["ttgir"])  # source locations dropped
loop = gpu_build.sass_opcodes(built.asm["cubin"], loop=True)
top = {op: loop.get(op, 0) for op in ("I2F", "PRMT", "LOP3", "HADD2", "LDS", "STS", "LDSM", "BAR", "HMMA")}
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()), **top,
                  "ttgir_sha256": hashlib.sha256(ttgir.encode()).hexdigest()[:16]}))
"""

print("triton", triton.__version__)
settings = sys.argv[1:] or ["BYTES=0,ROWS=0", "BYTES=1,ROWS=0", "BYTES=0,ROWS=1", "BYTES=1,ROWS=1"]
job = record("tiles", 64, 1)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for setting in settings:
    job["constants"].update({name: int(value) for name, value in (pair.split("=") for pair in setting.split(","))})
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"{setting}:", done.stdout.strip().splitlines()[-1], flush=True)
