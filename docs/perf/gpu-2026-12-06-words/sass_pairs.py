"""The ``tiles`` pass and its ``pairs`` form (two tokens a tile row, ``TILES_PAIRS``) built for sm_90 as
``fused_decode`` launches them over depthweave-kv's storage at the Llama-3-8B attention shape (32 query heads, 8 KV
heads): registers a thread, stack, the token loop's instructions (each once), and the loop's commonest instructions.
Run where the GPU's Triton is installed to count what it builds; on a machine without a GPU, Triton's CUDA backend
still builds (the counts of docs/kernels.md name the Triton they came from).

    python docs/perf/gpu-2026-12-06-words/sass_pairs.py [BLOCK ...]   (default 64)

The pairs form (``kernels/depthweave_pairs_triton.py``, ``TILES_PAIRS``) existed only in commits 376a0b2 to d78507a:
timed slower than the ``tiles`` pass at every shape (run 1), it was taken back. Run this over that tree
(``git archive d78507a | tar -x -C somewhere``), from its root."""
import json
import os
import subprocess
import sys

import triton

BUILD = """
import importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
built = gpu_build.build(importlib.import_module(job["module"]), job)
loop = gpu_build.sass_opcodes(built.asm["cubin"], loop=True)
print(json.dumps({**gpu_build.resources(built.asm["cubin"]), "loop": sum(loop.values()),
                  "top": dict(loop.most_common(12))}))
"""


def record(pairs: bool, block: int) -> dict:
    """The build job of one ``fused_decode`` launch of the tiles pass (``pairs``: its pairs form), run interpreted
    with the kernel recorded, not run."""
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from transformers import LlamaConfig

    from kvweave.core.registry import load_pipeline
    from kvweave.engine.cache import KVWeaveCache
    from kvweave.engine.synthetic import fill_cache
    from kvweave.kernels import depthweave_decode, depthweave_pairs_triton, depthweave_tiles_triton
    from kvweave.kernels.gpu_build import launch_job

    config = LlamaConfig(vocab_size=128, hidden_size=4096, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    cache = fill_cache(KVWeaveCache(load_pipeline("depthweave-kv"), config), 2, 320, chunk=107,
                       dtype=torch.bfloat16, device="cpu", seed=1)
    view = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cpu"))
    module, name = (depthweave_pairs_triton, "_pairs_kernel") if pairs else (depthweave_tiles_triton, "_tiles_kernel")
    kernel, launches = getattr(module, name), []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((args, constants))

    setattr(module, name, Recorder())
    depthweave_decode.TILES_PAIRS = pairs
    try:
        depthweave_decode.fused_decode(view, torch.randn(2, 32, 128), None, 0.1, block_tokens=block, variant="tiles")
    except Exception:  # the exact-window pass and the combine need the recorded pass's outputs
        pass
    setattr(module, name, kernel)
    args, constants = launches[0]
    job = launch_job(kernel, args, constants)
    job["constants"].update(ASM=True, BYTES=True)  # what a GPU's launch sets
    return job


print("triton", triton.__version__)
env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
for block in [int(b) for b in sys.argv[1:]] or [64]:
    for pairs in (False, True):
        job = record(pairs, block)
        done = subprocess.run([sys.executable, "-c", BUILD], input=json.dumps(job), capture_output=True, text=True,
                              env=env)
        if done.returncode:
            raise SystemExit(done.stderr[-3000:])
        print(f"BLOCK={block} {'pairs' if pairs else 'tiles'}:", done.stdout.strip().splitlines()[-1], flush=True)
