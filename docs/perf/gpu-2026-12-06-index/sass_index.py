"""The ``tiles`` decode pass (the codes as words a step ahead, byte permutes, 64-token steps) built for sm_90 under
settings ``INDEX:CAP:LATE:UNROLL``: its tile index read two steps ahead (``INDEX``, as ``TILES_INDEX`` passes it) or
not, a register cap (``maxnreg``, ``none`` for the compiler's choice), the query's products after the first step's
loads (``LATE``, ``TILES_QUERY_LATE``), and the token loop unrolled (``UNROLL`` > 1: built from a copy of the module
whose loop is ``tl.range(..., loop_unroll_factor=UNROLL)``; not a setting of the package). Printed per setting:
registers a thread, stack bytes; the token loop's instructions, loads by width, spilled loads and stores, register
moves (``IMAD.MOV``) and tensor-core products (an unrolled loop holds UNROLL steps); the loads before the loop that
the program issues before its first tensor-core product and after it. On the installed Triton; a machine without a
GPU builds with Triton's CUDA backend.

    python docs/perf/gpu-2026-12-06-index/sass_index.py [INDEX:CAP:LATE:UNROLL ...]
        (default: 0:none:0:1 1:none:0:1 1:192:0:1 0:none:1:1 0:none:1:2)

The launch is recorded by ../h200-2026-12-04-tiles/sass_tiles.py (``depthweave-kv`` storage, interpreted) and built in
a process without the interpreter."""
import json
import os
import subprocess
import sys
import tempfile

import triton

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "h200-2026-12-04-tiles"))
from sass_tiles import record  # noqa: E402

from kvweave.kernels import depthweave_tiles_triton  # noqa: E402

BUILD = """
import collections, importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
cubin = gpu_build.build(importlib.import_module(job["module"]), job).asm["cubin"]
code, labels = gpu_build.sass_listing(cubin)
start, end = gpu_build.token_loop(code, labels)
loop = [(op, rest) for address, op, guard, rest in code if start <= address <= end]
widths = collections.Counter(op + (rest.split()[0] if rest.startswith(".") else "") for op, rest in loop if op == "LDG")
before = [op for address, op, guard, rest in code if address < start]
first = before.index("HMMA") if "HMMA" in before else len(before)
print(json.dumps({**gpu_build.resources(cubin), "loop": len(loop), "loads": dict(sorted(widths.items())),
                  "LDL": sum(op == "LDL" for op, _ in loop), "STL": sum(op == "STL" for op, _ in loop),
                  "moves": sum(op == "IMAD" and rest.startswith(".MOV") for op, rest in loop),
                  "HMMA": sum(op == "HMMA" for op, _ in loop), "loads_before_first_mma": before[:first].count("LDG"),
                  "loads_after_it": before[first:].count("LDG")}))
"""
LOOP = "for t0 in range(lo, hi, BLOCK):"


def unrolled(folder: str, factor: int) -> str:
    """A copy of the tiles module in ``folder`` with its token loop unrolled ``factor`` times; its module name."""
    with open(depthweave_tiles_triton.__file__) as f:
        source = f.read()
    if source.count(LOOP) != 1:
        raise SystemExit(f"the tiles module's token loop ({LOOP!r}) is not where this script looks for it")
    with open(os.path.join(folder, "tiles_unrolled.py"), "w") as f:
        f.write(source.replace(LOOP, f"for t0 in tl.range(lo, hi, BLOCK, loop_unroll_factor={factor}):"))
    return "tiles_unrolled"


print("triton", triton.__version__)
job = record("tiles", 64, 1)
job["constants"].update(ASM=True, BYTES=True, ROWS=True, WORDS=2)
with tempfile.TemporaryDirectory() as folder:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (folder, env.get("PYTHONPATH")) if p)
    for setting in sys.argv[1:] or ["0:none:0:1", "1:none:0:1", "1:192:0:1", "0:none:1:1", "0:none:1:2"]:
        index, cap, late, unroll = (setting + ":0:0:1").split(":")[:4]
        built = {**job, "constants": {**job["constants"], "INDEX": bool(int(index)), "QUERY_LATE": bool(int(late))},
                 "maxnreg": None if cap == "none" else int(cap)}
        if int(unroll) > 1:
            built["module"] = unrolled(folder, int(unroll))
        done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(built), capture_output=True, text=True,
                              env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(f"INDEX={index} maxnreg={cap} QUERY_LATE={late} UNROLL={unroll}:", done.stdout.strip().splitlines()[-1],
              flush=True)
