"""The torch operations a decode-time flush makes, counted on the CPU: a tiny model of Llama-3-8B's head shape, the
`kzd-k4v2-f48-d128` pipeline filled as benchmarks/decode_e2e.py fills it, 70 decode steps (one flush of each layer),
every aten operation dispatched inside ``CompressionEngine._flush`` counted. On a GPU at small batches the flush is
bound by the host's time per operation. ``--every-block``: the sinks router's ``routed_tokens`` switched off, so every
flushed block is reconstructed (as before it existed).

    python docs/perf/h200-2026-12-03-split/flush_ops.py [--every-block]      (from the repository's root)
"""

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, "benchmarks")
import decode_e2e as D  # noqa: E402

if "--every-block" in sys.argv:
    from kvweave.plugins.routers.sinks import SinkRouter

    SinkRouter.routed_tokens = lambda self, kind, first: None

D.REGISTRY = "benchmarks/dense_sweep.toml"
LAYERS = 2
model = D.random_model(D.smoke_config(LAYERS), "cpu")
cache = D.make_cache("kzd-k4v2-f48-d128", model, 1, 2048, "cpu", fill_rows=1)
engine = cache.engine
ops: Counter = Counter()
flush = engine._flush


class Count(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def counted(group):
    with Count():
        return flush(group)


object.__setattr__(engine, "_flush", counted)
D.generate_steps(model, cache, 1, 2048, 70, "cpu", D.StepClock())
flushed = sum(store["keys"].flushes for store in engine.stores) - LAYERS  # the fill's own flush of each layer
print(f"{flushed} layer flushes: {sum(ops.values())} torch operations, {sum(ops.values()) / max(flushed, 1):.0f} a layer")
print("most frequent:", ", ".join(f"{name} {count}" for name, count in ops.most_common(8)))
