"""``benchmarks/lowbit_kernel.py`` with the dense kernel's switches set, to time one build against another:

    python docs/perf/h200-2026-12-03-planes/switches.py ROWS [lowbit_kernel.py's arguments]

ROWS: the fewest query rows a KV head's tile takes (``MIN_TILE_ROWS["dense"]``: 16 before 2026-12-03, 8 since); the
environment's PLANES=0/1 (``DENSE_KEY_PLANES``), KPF=0/1 (``DENSE_PLANE_PREFETCH``) and STAGES=n (Triton's
``num_stages`` for the dense launch) and MAXNREG=n (its register cap, ``DENSE_MAX_REGISTERS``) where set."""

import os
import runpy
import sys
from pathlib import Path

import kvweave.kernels.lowbit_decode as decode
import kvweave.kernels.lowbit_dense as dense

decode.MIN_TILE_ROWS["dense"] = int(sys.argv.pop(1))
if os.environ.get("PLANES"):
    dense.DENSE_KEY_PLANES = os.environ["PLANES"] == "1"
if os.environ.get("KPF"):
    dense.DENSE_PLANE_PREFETCH = os.environ["KPF"] == "1"
if os.environ.get("MAXNREG"):
    dense.DENSE_MAX_REGISTERS = int(os.environ["MAXNREG"])
if os.environ.get("STAGES"):
    plain = dense.dense_launch

    def staged(*args, **kwargs):
        kernel, grid, launch_args, constants = plain(*args, **kwargs)
        return kernel, grid, launch_args, {**constants, "num_stages": int(os.environ["STAGES"])}

    decode.dense_launch = staged
script = Path(__file__).resolve().parents[3] / "benchmarks" / "lowbit_kernel.py"
sys.argv[0] = str(script)
sys.path.insert(0, str(script.parent))
runpy.run_path(str(script), run_name="__main__")
