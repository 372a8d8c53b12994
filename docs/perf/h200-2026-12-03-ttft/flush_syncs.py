"""The host synchronizations in a decode-time flush, counted on the CPU: a tiny model of Llama-3-8B's head shape, the
`kzd-k4v2-f48-d128` pipeline filled as benchmarks/decode_e2e.py fills it, 70 decode steps (one flush of each layer),
and every torch call that reads a tensor on the host (``item``, ``tolist``, ``bool``/``int``/``float``, ``unique``,
``equal``, ``any``/``all``, ``nonzero``, sorts) inside ``CompressionEngine._flush`` counted by where it was made.
On a GPU each is a synchronization between small kernels.

    python docs/perf/h200-2026-12-03-ttft/flush_syncs.py      (from the repository's root)
"""

import sys
import traceback
from collections import Counter

import torch
import torch.overrides

sys.path.insert(0, "benchmarks")
import decode_e2e as D  # noqa: E402

HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "equal", "nonzero", "sort",
              "argsort", "any", "all"}

D.REGISTRY = "benchmarks/dense_sweep.toml"
model = D.random_model(D.smoke_config(2), "cpu")
cache = D.make_cache("kzd-k4v2-f48-d128", model, 4, 2048, "cpu", fill_rows=4)
engine = cache.engine
sites: Counter = Counter()
work = Counter()
flush = engine._flush


class Spy(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        if name in HOST_READS:
            frames = traceback.extract_stack(limit=6)[:-1][-3:]
            sites[(name, " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in reversed(frames)))] += 1
        return func(*args, **(kwargs or {}))


def counted(group):
    before = sum(sites.values())
    with Spy():
        out = flush(group)
    work["flushes that read the host"] += sum(sites.values()) > before
    return out


object.__setattr__(engine, "_flush", counted)
D.generate_steps(model, cache, 4, 2048, 70, "cpu", D.StepClock())
layers = work["flushes that read the host"]
print(f"{layers} layer flushes read the host {sum(sites.values())} times ({sum(sites.values()) / max(layers, 1):.1f} a layer):")
for (name, site), count in sites.most_common():
    print(f"{count:4d}  {name:10s} {site}")
