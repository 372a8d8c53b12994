"""What storing a scored context costs the host: operations dispatched and host reads, by flush stage.

    python benchmarks/ingest_ops.py [--pipeline kzd-k4v2-f48-d128-s] [--registry FILE] [--tokens 256] [--layers 32] [--per-pass 4]

A pipeline whose evictor takes a surrogate's scores stores its prompt after the scoring forward, layer by layer
(:func:`kvweave.engine.ingest.ingest`). On a GPU those flushes wait on the host (each torch operation is a launch,
each host read a synchronization), so their count, not the device's arithmetic, sets their time. This script runs the
ingest once on the CPU for a tiny model of the Llama-3-8B head shape (``decode_e2e.smoke_config``), with the checks
deferred as on a GPU, and prints per stage the torch operations dispatched, the host reads (``item``, ``tolist``,
``bool`` of a tensor, ...) and the seconds. At a few hundred tokens the arithmetic is small, so the seconds are
mostly host work too. ``--registry``: e.g. the file ``benchmarks/surrogate_registry.py --smoke`` writes.
"""

from __future__ import annotations

import argparse
import time
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kvweave.engine.importance as importance_module
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache

from decode_e2e import Ids, random_model, smoke_config

#: torch calls that read a tensor on the host (each one a synchronization on a GPU; ``any``/``all`` are counted when
#: their answer is read, as ``__bool__``)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "equal", "nonzero"}
#: the flush's stages, innermost first: each operation is charged to the innermost one it ran in
STAGES = ("router.assign", "encoder.rank_counts", "quantizer.quantize", "quantizer.dequantize", "encoder.encode_members",
          "evictor.keep", "eviction._whole_groups", "eviction._kept_index", "encoder.encode", "eviction.evict",
          "engine._flush")


class Counted(TorchDispatchMode):
    """Counts dispatched aten operations and host reads, charged to the innermost stage on ``stack``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = ["(ingest)"]
        self.ops: Counter = Counter()
        self.reads: Counter = Counter()
        self.sites: Counter | None = None  # (read, file:line) -> count, with --sites
        self.names: Counter | None = None  # (stage, operation) -> count, with --names N

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[self.stack[-1]] += 1
        if self.names is not None:
            self.names[(self.stack[-1], str(func.overloadpacket).removeprefix("aten."))] += 1
        return func(*args, **(kwargs or {}))


class Reads(torch.overrides.TorchFunctionMode):
    def __init__(self, counted: Counted) -> None:
        super().__init__()
        self.counted = counted

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.counted.reads[self.counted.stack[-1]] += 1
            if self.counted.sites is not None:
                frame = next((f for f in reversed(traceback.extract_stack(limit=12)[:-1]) if "/kvweave/" in f.filename or "/engine/" in f.filename or "/plugins/" in f.filename), None)
                self.counted.sites[(name, f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno}" if frame else "?")] += 1
        return func(*args, **(kwargs or {}))


def staged(counted: Counted, seconds: Counter, name: str, fn):
    def wrapper(*args, **kwargs):
        counted.stack.append(name)
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[name] += time.perf_counter() - start
            counted.stack.pop()
    return wrapper


def wrap_stages(cache, counted: Counted, seconds: Counter) -> None:
    engine = cache.engine
    owners = {"router": engine.router, "quantizer": None, "encoder": engine.encoder, "evictor": engine.evictor,
              "eviction": engine.eviction, "engine": engine}
    for stage in STAGES:
        owner_name, method = stage.split(".")
        if owner_name == "quantizer":
            for group in engine.group_quantizers:
                for quantizer in group.values():
                    cls = type(quantizer)
                    if not getattr(getattr(cls, method), "_staged", False):
                        wrapped = staged(counted, seconds, stage, getattr(cls, method))
                        wrapped._staged = True
                        setattr(cls, method, wrapped)
            continue
        owner = owners[owner_name]
        if owner_name in ("router", "evictor"):  # frozen components: their class's method
            cls = type(owner)
            if not getattr(getattr(cls, method), "_staged", False):
                wrapped = staged(counted, seconds, stage, getattr(cls, method))
                wrapped._staged = True
                setattr(cls, method, wrapped)
        else:
            object.__setattr__(owner, method, staged(counted, seconds, stage, getattr(owner, method)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipeline", default="kzd-k4v2-f48-d128-s")
    parser.add_argument("--registry", help="a user registry file read on top of the built-in one")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--sites", action="store_true", help="also list where each host read was made")
    parser.add_argument("--names", type=int, default=0, help="also list the N most dispatched operations, by stage")
    parser.add_argument("--per-pass", type=int, default=0,
                        help="layers a pass of the together store (0: as the CPU sizes it; 4: a GPU's at 32K on Llama-3-8B's shape)")
    args = parser.parse_args()
    if args.per_pass:
        import kvweave.engine.ingest as ingest_module
        import kvweave.engine.together as together_module

        for module in (ingest_module, together_module):
            module.layers_a_pass = lambda *_args: args.per_pass
    model = random_model(smoke_config(args.layers), "cpu")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), generator=torch.Generator().manual_seed(0))
    pipeline = load_pipeline(args.pipeline, args.registry)
    for attempt in ("warm-up", "counted"):
        cache = build_cache(pipeline, model, tokenizer=Ids(model.config.vocab_size))
        cache.engine.defer_checks = True  # as on a GPU: the flushes' checks read the host once, at the end
        counted, seconds = Counted(), Counter()
        original = importance_module.ingest_context
        total = [0.0]

        def ingest(*call, counted=counted, original=original):
            start = time.perf_counter()
            with counted, Reads(counted):
                original(*call)
            total[0] = time.perf_counter() - start

        importance_module.ingest_context = ingest
        if attempt == "counted":
            wrap_stages(cache, counted, seconds)
            counted.sites = Counter() if args.sites else None
            counted.names = Counter() if args.names else None
        try:
            stored = importance_module.score_for(model, cache, ids, ingest=True)
        finally:
            importance_module.ingest_context = original
    if not stored:
        raise SystemExit(f"pipeline '{args.pipeline}' did not store its context without a forward (no scored ingest)")
    layers = args.layers
    print(f"{args.pipeline}: {stored} tokens stored for {layers} layers in {total[0]:.3f} s "
          f"({total[0] / layers * 1e3:.2f} ms a layer), {sum(counted.ops.values()):,} operations "
          f"({sum(counted.ops.values()) / layers:.0f} a layer), {sum(counted.reads.values())} host reads; "
          f"{cache.compression_ratio():.2f}x smaller")
    print("| stage (own work) | operations | host reads | seconds (with nested stages) |")
    print("|---|---:|---:|---:|")
    for stage in sorted(set(counted.ops) | set(counted.reads), key=lambda s: -counted.ops[s]):
        print(f"| {stage} | {counted.ops[stage]:,} | {counted.reads[stage]} | {seconds.get(stage, total[0]):.3f} |")
    if counted.names:
        print("\n| stage | operation | count |\n|---|---|---:|")
        for (stage, name), count in counted.names.most_common(args.names):
            print(f"| {stage} | {name} | {count:,} |")
    if counted.sites:
        print("\n| host read | where | count |\n|---|---|---:|")
        for (name, where), count in counted.sites.most_common():
            print(f"| {name} | {where} | {count} |")


if __name__ == "__main__":
    main()

