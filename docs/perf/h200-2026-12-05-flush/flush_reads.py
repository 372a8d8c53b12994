"""Host reads (a value or a size read from the device) in a prompt's forward and in a decode step that flushes:
``depthweave-kv`` on the 32-layer CPU model of ``decode_e2e.py --smoke`` (the Llama-3-8B head shape), its checks
deferred as on a GPU, counted by the kvweave function that made them (the attention kernel's CPU twin left out: a GPU
runs the Triton kernel). On a GPU each read stops the host until the device has run all it was given.

    python docs/perf/h200-2026-12-05-flush/flush_reads.py [PIPELINE]   (default depthweave-kv)

For another tree (e.g. the one before): ``git worktree add /tmp/before <commit>; mkdir /tmp/hk; ln -s /tmp/before
/tmp/hk/kvweave``, then from /tmp/before: ``PYTHONPATH=/tmp/hk:/tmp/before/benchmarks python <this script>``.
"""
import os
import sys
import traceback
from collections import Counter

import torch

sys.path.insert(0, "benchmarks")
from decode_e2e import Ids, random_model, smoke_config  # noqa: E402

import kvweave.engine  # noqa: E402
from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine import build_cache  # noqa: E402
from kvweave.engine.graphs import steps_before_flush  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvweave.engine.__file__)))  # the package's files, wherever installed
HOST = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "equal", "nonzero"}
TWIN = ("torch_decode", "torch_packed_logsumexp", "_token_versions", "torch_fused")  # the kernel's CPU twin


class Reads(torch.overrides.TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.sites = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST:
            frames = [f for f in traceback.extract_stack(limit=30)[:-1] if os.path.abspath(f.filename).startswith(ROOT)
                      and os.path.basename(f.filename) != os.path.basename(__file__)]
            if frames and not any(f.name in TWIN for f in frames):
                self.sites[f"{os.path.basename(frames[-1].filename)}:{frames[-1].name}"] += 1
        return func(*args, **(kwargs or {}))


def step(model, cache, ids):
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)


model = random_model(smoke_config(32), "cpu")
cache = build_cache(load_pipeline(sys.argv[1] if len(sys.argv) > 1 else "depthweave-kv"), model, tokenizer=Ids(model.config.vocab_size))
cache.engine.defer_checks = True  # as on a GPU
with torch.no_grad():
    with Reads() as prompt:
        token = step(model, cache, torch.randint(0, model.config.vocab_size, (1, 1024)))
    for _ in range(steps_before_flush(cache.engine)):
        token = step(model, cache, token)
    with Reads() as flush:
        step(model, cache, token)
for name, reads in (("prompt", prompt), ("decode flush", flush)):
    print(name, sum(reads.sites.values()), dict(reads.sites.most_common()))
