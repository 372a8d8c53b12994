"""The machine instructions of the ``lowbit`` decode kernels as built for an H100/H200 (sm_90; ``--arch``), counted by class,
without a GPU: Triton compiles the launch ``benchmarks/lowbit_kernel.py`` makes and its nvdisasm lists the code.

    python benchmarks/kernel_sass.py [--storages k4v2,qa35v3,k4v2-post] [--configs wide:,wide:magic,...] [--arch 90] [--asm 1|2]
        [--batch 1] [--tokens 512] [--out FILE]
    python benchmarks/kernel_sass.py --method depthweave-kv [--tokens 2048] [--batch 1]   (KVWEAVE_TILES_REGISTERS: its cap; 0: none)

A configuration is ``variant:tricks`` (tricks "+"-separated names of ``kvweave.kernels.lowbit_decode.TRICKS``, empty
for none); ``k4v2-post`` is prerope-k4v2's storage read as keys stored after RoPE, a ``-uniform`` suffix puts its
values on uniform levels, a ``-hidden`` suffix (last) launches it with a list of 4 hidden slots a row; the last columns are
the build's registers a thread and stack bytes (its cuobjdump) and its local-memory loads and stores (``LDL``/``STL``:
registers spilled), in the build and in its token loop. The build is the installed Triton's (its version printed
first: the GPU machine's Triton 3.6 and a Triton 3.9 build different products, so count with the one that runs).
Counts are static (each
instruction of the kernel once, the token loop's body included once; "token loop" the body alone, and per key and value
element a thread handles in one step): they say which instructions a change removes or
adds, not how often they run or how fast a GPU issues them; that is ``benchmarks/lowbit_kernel.py``'s to time.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import json
import os
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # built for the GPU, not run in the interpreter

import attrs  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402

from kvweave.kernels.gpu_build import build, launch_job, resources, sass_opcodes  # noqa: E402
from kvweave.kernels.lowbit_decode import plan_launch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

#: opcode classes of the table (anything else counts in "other")
CLASSES = {
    "conversions": ("I2F", "I2FP", "F2F", "F2FP", "F2I", "I2I"),
    "float": ("FADD", "FMUL", "FFMA", "FSEL", "FMNMX", "FSETP", "MUFU", "FRND", "HADD2", "HFMA2", "HMUL2"),
    "integer": ("IMAD", "IADD3", "LOP3", "SHF", "PRMT", "ISETP", "SEL", "LEA", "SGXT", "VIADD", "IABS", "IMNMX", "VIMNMX"),
    "memory": ("LDG", "LDS", "STS", "STG", "LDSM", "LDGSTS", "LDC", "ULDC"),
    "tensor": ("HMMA", "HGMMA", "IMMA"),
}


def counts(storage: str, variant: str, tricks: str, arch: int = 90, asm: int | None = None, batch: int = 1,
           tokens: int = 512) -> dict:
    """One table row: ``storage``'s launch of ``variant`` with ``tricks`` for ``batch`` rows of ``tokens`` tokens, built for ``sm_{arch}``, its
    opcodes by class; ``asm``: the dense kernel's ``ASM`` (1: plain operands, 2: the tiled values' operands fenced)
    instead of the launch's own."""
    hidden = storage.endswith("-hidden")
    base = storage.removesuffix("-hidden").removesuffix("-uniform")
    view = packed_view(batch, tokens, device="cpu", storage=base.removesuffix("-post"))  # a group of 128 kept too
    if hidden:  # a list of 4 hidden slots a row, as restored tokens that are no prefix of the positions give it
        view = attrs.evolve(view, hidden_slots=torch.full((view.k_codes.shape[0], 4), -1, dtype=torch.int32))
    if base.endswith("-post"):
        view = attrs.evolve(view, inv_freq=None)
    if storage.removesuffix("-hidden").endswith("-uniform"):  # the values on uniform levels (code - (2**bits - 1) / 2) instead of the storage's
        count = 1 << view.v_bits
        view = attrs.evolve(view, v_levels=torch.arange(count, dtype=torch.float32) - (count - 1) / 2, level_kind=(1, 0.0, 0.0))
    q = torch.randn(batch, Q_HEADS, HEAD_DIM)
    launch = plan_launch(view, q, None, HEAD_DIM ** -0.5, variant=variant, lowp=True, tricks=tricks)
    constants = launch.constants if asm is None or "ASM" not in launch.constants else {**launch.constants, "ASM": asm}
    job = launch_job(launch.kernel, launch.args, constants)
    cubin = build(importlib.import_module(job["module"]), job, arch=arch).asm["cubin"]
    elements = launch.constants["BLOCK"] * HEAD_DIM * 2 / (32 * launch.constants["num_warps"])  # keys and values a thread, a step
    return _row(cubin, storage, f"{variant}:{tricks}", arch, batch, tokens, elements)


def _row(cubin: bytes, storage: str, config: str, arch: int, batch: int, tokens: int, elements: float) -> dict:
    """A table row of ``cubin``: its opcodes by class, in the build and in its token loop (``elements``: keys and
    values a thread handles in one step), its registers, stack and spills."""
    ops = sass_opcodes(cubin)
    body = sass_opcodes(cubin, loop=True)
    row: dict = {"storage": storage, "config": config, "triton": triton.__version__, "arch": arch, "batch": batch,
                 "tokens": tokens, "total": sum(ops.values()), "loop": sum(body.values()),
                 "per_element": sum(body.values()) / elements, **resources(cubin),
                 "spills": sum(ops[m] for m in ("STL", "LDL")), "loop_spills": sum(body[m] for m in ("STL", "LDL"))}
    for name, members in CLASSES.items():
        row[name] = sum(ops[m] for m in members)
    row["other"] = row["total"] - sum(row[name] for name in CLASSES)
    row["opcodes"] = dict(collections.Counter(ops).most_common())
    row["loop_opcodes"] = dict(collections.Counter(body).most_common())
    return row


def tiles_counts(tokens: int, batch: int = 1, arch: int = 90) -> dict:
    """depthweave-kv's tiles pass as its decode call launches it for ``batch`` rows over a cache of ``tokens`` tokens
    filled as ``benchmarks/decode_kernel.py`` fills it (Llama-3-8B attention shape, layer 1; on the CPU), built for
    ``sm_{arch}`` with the GPU's inline assembly: one table row."""
    from decode_kernel import llama3_window_config

    from kvweave.core.registry import load_pipeline
    from kvweave.engine.cache import KVWeaveCache
    from kvweave.engine.synthetic import fill_cache
    from kvweave.kernels import depthweave_decode, depthweave_tiles_triton

    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, batch, tokens, chunk=2048, device="cpu", seed=tokens)
    view = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cpu"))
    launches: list = []

    class Recorder:  # the tiles pass's launch, recorded instead of run; the call stops at the next kernel
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((args, constants))

    kernel = depthweave_tiles_triton._tiles_kernel
    depthweave_tiles_triton._tiles_kernel = Recorder()
    try:
        depthweave_decode.fused_decode(view, torch.randn(batch, Q_HEADS, HEAD_DIM).to(torch.bfloat16), None,
                                       HEAD_DIM ** -0.5, variant="tiles")
    except RuntimeError:  # the exact-window pass, launched for real with no GPU
        pass
    finally:
        depthweave_tiles_triton._tiles_kernel = kernel
    if not launches:
        raise SystemExit("kernel_sass.py: depthweave-kv's decode call launched no tiles pass")
    args, constants = launches[0]
    job = launch_job(kernel, args, constants)
    job["constants"].update(ASM=True, BYTES=bool(depthweave_decode.TILES_BYTES))  # a GPU's launch (ASM: is_cuda)
    if depthweave_decode.tiles_register_cap():  # the cap a GPU's launch passes (KVWEAVE_TILES_REGISTERS, else the rule)
        job["maxnreg"] = depthweave_decode.tiles_register_cap()
    return _row(build(importlib.import_module(job["module"]), job, arch=arch).asm["cubin"], "depthweave-kv", "tiles:",
                arch, batch, tokens, constants["BLOCK"] * HEAD_DIM * 2 / (32 * constants.get("num_warps", 4)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storages", default="k4v2,qa35v3,k4v2-post")
    parser.add_argument("--configs", default="wide:,wide:magic,wide:magic+vb16,wide:ktf32,wide:magic+vb16+ktf32,wide:kfold+vb16")
    parser.add_argument("--arch", type=int, default=90, help="the GPU generation built for (90: H100/H200, 80: A100)")
    parser.add_argument("--asm", type=int, choices=(1, 2), default=None,
                        help="the dense kernel's ASM instead of the launch's (2: the tiled values' operands fenced, as for Ampere products)")
    parser.add_argument("--method", choices=("lowbit", "depthweave-kv"), default="lowbit",
                        help="lowbit: the storages' launches (--storages, --configs); depthweave-kv: its tiles pass over a "
                             "cache filled as decode_kernel.py fills it (--tokens, --batch; about 15 s at 2048 tokens)")
    parser.add_argument("--batch", type=int, default=1, help="rows the launch is planned for (1: one wave, the launch's "
                        "register cap where it takes one; 8: past one wave at Llama-3-8B's shape)")
    parser.add_argument("--tokens", type=int, default=512, help="context tokens a row the launch is planned for (with "
                        "--batch 8, 32768 gives more than one wave of programs: the launch's register cap for that case)")
    parser.add_argument("--out", default=None, help="JSON file for the rows (each with every opcode's count, in the build and in its token loop)")
    args = parser.parse_args()
    rows = []
    print(f"Triton {triton.__version__}, sm_{args.arch} (for sm_90 a Triton before 3.8 builds Ampere mma.sync products, later "
          "ones warpgroup products: the counts differ)")
    print("| storage | variant:tricks | instructions | conversions | float | integer | memory | tensor | other | token loop | "
          "loop per key/value element a thread | registers (stack bytes) | spill loads + stores (in the loop) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    if args.method == "depthweave-kv":
        args.storages, args.configs = "depthweave-kv", "tiles:"
    for storage in args.storages.split(","):
        for config in args.configs.split(","):
            variant, _, tricks = config.partition(":")
            try:
                row = (tiles_counts(args.tokens, args.batch, args.arch) if args.method == "depthweave-kv" else
                       counts(storage, variant, tricks, args.arch, args.asm, args.batch, args.tokens))
            except ValueError as error:  # a trick this storage cannot take (kfold reads keys after RoPE)
                print(f"| {storage} | `{config}` | refused: {error} | | | | | | |")
                continue
            rows.append(row)
            print(f"| {storage} | `{config}` | {row['total']} | {row['conversions']} | {row['float']} | {row['integer']} | "
                  f"{row['memory']} | {row['tensor']} | {row['other']} | {row['loop']} | {row['per_element']:.1f} | "
                  f"{row['registers']} ({row['stack']}) | {row['spills']} ({row['loop_spills']}) |", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
