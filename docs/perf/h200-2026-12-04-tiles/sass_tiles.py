"""Registers and token-loop instructions of the fused kernel's packed-token passes as built for sm_90, on a CPU.

    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-04-tiles/sass_tiles.py tiles 64 1
    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-04-tiles/sass_tiles.py gather 64 1

Arguments: the pass (tiles or gather), tokens a step, warps a program. The launch is recorded from a real
``fused_decode`` call (``depthweave-kv`` storage of a Llama-3-8B-shaped layer, 320 tokens, interpreted), then built
for sm_90 in a process without the interpreter (the GPU's population count included); the token loop is
:func:`kvweave.kernels.gpu_build.token_loop`'s innermost longest loop, each instruction counted once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

BUILD = """
import importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
built = gpu_build.build(importlib.import_module(job["module"]), job)
loop = gpu_build.sass_opcodes(built.asm["cubin"], loop=True)
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()), "top": loop.most_common(12)}))
"""


def record(variant: str, block: int, warps: int) -> dict:
    """The build job of one ``fused_decode`` launch of ``variant`` (run interpreted, the kernel not run)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from transformers import LlamaConfig

    from kvweave.core.registry import load_pipeline
    from kvweave.engine.cache import KVWeaveCache
    from kvweave.engine.synthetic import fill_cache
    from kvweave.kernels import decode_triton, depthweave_decode, depthweave_tiles_triton
    from kvweave.kernels.gpu_build import launch_job

    config = LlamaConfig(vocab_size=128, hidden_size=4096, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    cache = fill_cache(KVWeaveCache(load_pipeline("depthweave-kv"), config), 2, 320, chunk=107,
                       dtype=torch.bfloat16, device="cpu", seed=1)
    view = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cpu"))
    module, name = (depthweave_tiles_triton, "_tiles_kernel") if variant == "tiles" else (decode_triton, "_packed_split_kernel")
    kernel, launches = getattr(module, name), []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((args, constants))

    setattr(module, name, Recorder())
    try:
        depthweave_decode.fused_decode(view, torch.randn(2, 32, 128), None, 0.1, block_tokens=block, num_warps=warps,
                                       variant=variant)
    except Exception:  # the exact-window pass and the combine need the recorded pass's outputs
        pass
    setattr(module, name, kernel)
    args, constants = launches[0]
    job = launch_job(kernel, args, constants)
    if "ASM" in job["constants"]:
        job["constants"]["ASM"] = True  # the GPU's population count
    return job


if __name__ == "__main__":
    variant, block, warps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    job = record(variant, block, warps)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(job), capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    print(f"{variant}, {block} tokens a step, {warps} warp(s):", done.stdout.strip().splitlines()[-1])
