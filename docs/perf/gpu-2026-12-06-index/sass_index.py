"""The ``tiles`` decode pass (the codes as words a step ahead, byte permutes, 64-token steps) built for sm_90 with its
tile index read two steps ahead (``INDEX``, as ``TILES_INDEX`` passes it) or not, each under an optional register cap,
and with the query's products after the first step's loads (``QUERY_LATE``, ``TILES_QUERY_LATE``): registers a
thread, stack bytes, the token loop's instructions, loads and spilled loads, and the loads before the token loop
that the program issues before its first tensor-core product and after it. On the installed Triton; a
machine without a GPU builds with Triton's CUDA backend.

    python docs/perf/gpu-2026-12-06-index/sass_index.py [INDEX:CAP[:LATE] ...]   (default: 0:none:0 1:none:0 1:192:0 0:none:1)

The launch is recorded by ../h200-2026-12-04-tiles/sass_tiles.py (``depthweave-kv`` storage, interpreted) and built in
a process without the interpreter, by the build script of ../gpu-2026-12-06-words/sass_registers.py."""
import json
import os
import subprocess
import sys

import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "h200-2026-12-04-tiles"))
from sass_tiles import record  # noqa: E402

with open(os.path.join(HERE, "..", "gpu-2026-12-06-words", "sass_registers.py")) as f:
    BUILD = f.read().split('BUILD = """')[1].split('"""')[0].replace('"STL": loop.get("STL", 0)',
                                                                    '"STL": loop.get("STL", 0), "LDG": loop.get("LDG", 0)')
# the loads the program issues before its first tensor-core product, and after it up to the token loop
BUILD = BUILD.replace("print(json.dumps({", """code, labels = gpu_build.sass_listing(built.asm["cubin"])
start = gpu_build.token_loop(code, labels)[0]
ops = [c[1] for c in code if c[0] < start]
first = ops.index("HMMA") if "HMMA" in ops else len(ops)
print(json.dumps({"loads_before_first_mma": ops[:first].count("LDG"), "loads_after_it": ops[first:].count("LDG"), """)

print("triton", triton.__version__)
job = record("tiles", 64, 1)
job["constants"].update(ASM=True, BYTES=True, ROWS=True, WORDS=2)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for setting in sys.argv[1:] or ["0:none:0", "1:none:0", "1:192:0", "0:none:1"]:
    index, cap, late = (setting + ":0").split(":")[:3]
    built = {**job, "constants": {**job["constants"], "INDEX": bool(int(index)), "QUERY_LATE": bool(int(late))},
             "maxnreg": None if cap == "none" else int(cap)}
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(built), capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"INDEX={index} maxnreg={cap} QUERY_LATE={late}:", done.stdout.strip().splitlines()[-1], flush=True)
