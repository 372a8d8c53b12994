"""Storing a scored context layer by layer against together (engine/together.py): time, peak memory, and whether the
two caches hold the same bytes.

    python benchmarks/ingest_together.py [--tokens 32768] [--pipeline kzd-k4v2-f48-d128-s] [--registry FILE] [--repeats 2]
        [--pass-mib 1024,256] [--smoke]

On a Llama-3-8B-shaped model with random bf16 weights (``decode_e2e.llama3_8b``; ``--smoke``: the tiny CPU model of the
same head shape), one prompt of random token ids is scored (the pipeline's evictor's scorer) and stored without a
second forward, once with the flushes a layer at a time and once together, ``--repeats`` times each, alternating. The
store (``importance.ingest_context``) is timed alone, synchronized, and the peak of allocated memory during it is
read. Then every layer's stored keys and values (decoded), slots and byte counts of the last two caches are compared:
the script says ``identical`` or names the first difference (and exits with status 1). ``--registry``: e.g. the file
``benchmarks/surrogate_registry.py`` writes. ``--pass-mib``: the together store once for each of these pass sizes
(MiB of float32 keys a pass, ``together.PASS_BYTES`` on a GPU and ``PASS_BYTES_HOST`` elsewhere; default: the
shipped one).
"""

from __future__ import annotations

import argparse
import time

import torch

import kvweave.engine.importance as importance_module
import kvweave.engine.ingest as ingest_module
import kvweave.engine.together as together_module
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache

from decode_e2e import Ids, llama3_8b, random_model, smoke_config, sync

LAYERED = "layer by layer"


def store(model, pipeline, ids, mode: str) -> tuple[object, float, int]:
    """A cache filled with ``ids`` in ``mode``; the seconds and peak bytes (above the start) of its store."""
    cache = build_cache(pipeline, model, tokenizer=Ids(model.config.vocab_size))
    original_ingest, original_refusal = importance_module.ingest_context, ingest_module.together_refusal
    measured: dict[str, float] = {}

    def timed(*args):
        sync()
        base = torch.cuda.memory_allocated() if ids.is_cuda else 0
        if ids.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        original_ingest(*args)
        sync()
        measured["seconds"] = time.perf_counter() - start
        measured["peak"] = (torch.cuda.max_memory_allocated() - base) if ids.is_cuda else 0

    importance_module.ingest_context = timed
    if mode == LAYERED:
        ingest_module.together_refusal = lambda *_: "layer by layer (benchmarks/ingest_together.py)"
    try:
        stored = importance_module.score_for(model, cache, ids, ingest=True)
    finally:
        importance_module.ingest_context, ingest_module.together_refusal = original_ingest, original_refusal
    if not stored:
        raise SystemExit(f"pipeline '{pipeline.name}' did not store its context without a forward")
    return cache, measured["seconds"], int(measured["peak"])


def difference(a, b) -> str | None:
    """The first difference between two caches' stored state, or None."""
    if a.memory_breakdown() != b.memory_breakdown():
        return f"bytes differ: {a.memory_breakdown()} vs {b.memory_breakdown()}"
    for layer in range(a.engine.shape.num_layers):
        for kind in ("keys", "values"):
            if not torch.equal(a.engine.materialize(layer, kind), b.engine.materialize(layer, kind)):
                return f"layer {layer}'s stored {kind} differ"
        pa, pb = a.engine.windows[layer].positions, b.engine.windows[layer].positions
        if (pa is None) != (pb is None) or (pa is not None and not torch.equal(pa, pb)):
            return f"layer {layer}'s slots differ"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--pipeline", default="kzd-k4v2-f48-d128-s")
    parser.add_argument("--registry", help="a user registry file read on top of the built-in one")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--pass-mib", default="", help="pass sizes of the together store, MiB (comma-separated)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same head shape on the CPU (checks the script)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = random_model(smoke_config(args.layers) if args.smoke else llama3_8b(args.layers), device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device, generator=None)
    pipeline = load_pipeline(args.pipeline, args.registry)
    shipped = together_module.PASS_BYTES if device == "cuda" else together_module.PASS_BYTES_HOST
    sizes = [int(mib) << 20 for mib in args.pass_mib.split(",") if mib] or [shipped]
    modes = [LAYERED] + [f"together, {size >> 20} MiB a pass" for size in sizes]
    store(model, pipeline, ids, modes[-1])  # warm-up (kernels compiled, allocator grown)
    results: dict[str, list[tuple[float, int]]] = {mode: [] for mode in modes}
    last = {}
    for _ in range(args.repeats):
        for mode, size in zip(modes, [0] + sizes):
            together_module.PASS_BYTES = together_module.PASS_BYTES_HOST = size or shipped
            cache, seconds, peak = store(model, pipeline, ids, mode)
            results[mode].append((seconds, peak))
            last[mode] = cache
    print(f"{args.pipeline}, {args.tokens} tokens, {args.layers} layers, {device}: stored {last[modes[-1]].compression_ratio():.2f}x smaller")
    print("| store | best seconds | all | peak above the start (GiB) |")
    print("|---|---:|---|---:|")
    for mode in modes:
        times = [s for s, _ in results[mode]]
        print(f"| {mode} | {min(times):.3f} | {', '.join(f'{s:.3f}' for s in times)} | {max(p for _, p in results[mode]) / 2**30:.2f} |")
    differs = next((d for d in (difference(last[mode], last[LAYERED]) for mode in modes[1:]) if d is not None), None)
    print("stored state: " + ("identical to layer by layer (bytes, every layer's decoded keys and values, slots)" if differs is None else differs))
    if differs is not None:
        raise SystemExit(1)  # the together store must hold what the layer-by-layer flushes hold


if __name__ == "__main__":
    main()
