"""The registers, stack bytes and spills of every kernel Triton has built into its cache: what the launches that were
timed actually ran, as the GPU machine's own build made them (a static build, ``benchmarks/kernel_sass.py``, may differ).

    python benchmarks/triton_cache_resources.py [--cache DIR] [--match _dense] [--out FILE.md]

``--cache``: Triton's cache (default ``$TRITON_CACHE_DIR``, else ``~/.triton/cache``); ``--match``: only kernels whose
name holds it. One row a build, oldest first: the Triton that built it, the target, warps, the register cap it was given
(``maxnreg``), the registers a thread and stack bytes (cuobjdump), and the local-memory loads and stores (spills) in
the build and in its token loop (nvdisasm). Needs Triton's CUDA backend (its cuobjdump and nvdisasm); no GPU."""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys

from kvweave.kernels.gpu_build import nvdisasm, resources, sass_opcodes

SPILLS = ("LDL", "STL")


def cached_builds(cache: str, match: str = "") -> list[dict]:
    """One dict a cubin under ``cache`` whose kernel name holds ``match``, oldest first."""
    rows = []
    for path in glob.glob(os.path.join(cache, "*", "*.cubin")):
        name = os.path.splitext(os.path.basename(path))[0]
        if match not in name:
            continue
        meta_path = os.path.splitext(path)[0] + ".json"
        meta = json.load(open(meta_path)) if os.path.exists(meta_path) else {}
        cubin = open(path, "rb").read()
        used = resources(cubin)
        ops, loop = sass_opcodes(cubin), sass_opcodes(cubin, loop=True)
        target = meta.get("target") or {}
        rows.append({"kernel": name, "triton": meta.get("triton_version", "?"), "arch": target.get("arch", "?"),
                     "warps": meta.get("num_warps", "?"), "maxnreg": meta.get("maxnreg"), **used,
                     "spills": sum(ops.get(op, 0) for op in SPILLS), "loop_spills": sum(loop.get(op, 0) for op in SPILLS),
                     "built": os.path.getmtime(path), "dir": os.path.basename(os.path.dirname(path))[:12]})
    return sorted(rows, key=lambda row: row["built"])


def table(rows: list[dict]) -> str:
    lines = ["| kernel | Triton | arch | warps | cap | registers (stack bytes) | spill loads + stores (in the loop) | cache dir |",
             "|---|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['kernel']} | {r['triton']} | {r['arch']} | {r['warps']} | {r['maxnreg'] or '-'} | "
                     f"{r['registers']} ({r['stack']}) | {r['spills']} ({r['loop_spills']}) | {r['dir']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default=os.environ.get("TRITON_CACHE_DIR") or os.path.expanduser("~/.triton/cache"))
    parser.add_argument("--match", default="", help="only kernels whose name holds this")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args(argv)
    if nvdisasm() is None or nvdisasm("cuobjdump") is None:
        sys.exit("triton_cache_resources.py: needs Triton's CUDA backend (its cuobjdump and nvdisasm)")
    if not os.path.isdir(args.cache):
        sys.exit(f"triton_cache_resources.py: no Triton cache at {args.cache} (--cache)")
    text = table(cached_builds(args.cache, args.match))
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
