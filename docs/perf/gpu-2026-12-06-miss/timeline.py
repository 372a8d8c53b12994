"""Where depthweave-kv's first token at 32K waits: one overlapped first token (as decode_e2e.py times it, no
synchronized timers) under the torch profiler, then, in milliseconds from the first token's start: each flush's host
span (the engine's ``_flush`` call, marked by a profiler range), its kernels' first start, last end and busy time and
their stream; the forward's kernels' last end; the GPU's idle time inside the first token (no kernel on any stream)
and its longest gaps, each with the flush the host was issuing then. Kernels are matched to the host's launches by the
profiler's correlation ids. GPU only (``--smoke``: a tiny model on the CPU, host spans only).
Run from the repository's root: python docs/perf/gpu-2026-12-06-miss/timeline.py [--tokens 32768] [--pipeline depthweave-kv]"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))

import decode_e2e  # noqa: E402
from decode_e2e import Ids, llama3_8b, random_model, smoke_config, sync  # noqa: E402
from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine import build_cache  # noqa: E402

MARK = "flush:"


def marked(fn):
    @functools.wraps(fn)
    def wrapper(self, group_index, *args, **kwargs):
        with torch.profiler.record_function(f"{MARK}{group_index}"):
            return fn(self, group_index, *args, **kwargs)
    return wrapper


def busy(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The union of ``intervals`` (ns), sorted and merged."""
    merged: list[list[int]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--pipeline", default="depthweave-kv")
    parser.add_argument("--registry")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = random_model(smoke_config(4) if args.smoke else llama3_8b(32), device)
    model.set_attn_implementation("sdpa")
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)

    def fresh():
        return build_cache(load_pipeline(args.pipeline, args.registry), model, tokenizer=Ids(model.config.vocab_size))

    for _ in range(2):  # warm-up: kernels compiled, the allocator grown
        decode_e2e.first_token(model, fresh(), ids)
    sync()
    cache = fresh()
    engine_type = type(cache.engine)
    engine_type._flush = marked(engine_type._flush)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities) as prof:
        with torch.profiler.record_function("first-token"):
            decode_e2e.first_token(model, cache, ids)
            sync()
    events = prof.profiler.kineto_results.events()
    span = next(e for e in events if e.name() == "first-token" and e.device_type() == torch.autograd.DeviceType.CPU)
    t0, t1 = span.start_ns(), span.end_ns()
    ms = lambda ns: (ns - t0) / 1e6  # noqa: E731
    cpu = torch.autograd.DeviceType.CPU
    flushes = sorted(((int(e.name()[len(MARK):]), e.start_ns(), e.end_ns()) for e in events
                      if e.name().startswith(MARK) and e.device_type() == cpu), key=lambda f: f[1])
    launches = {e.correlation_id(): e.start_ns() for e in events if e.device_type() == cpu and e.correlation_id()
                and e.name().startswith("cu")}  # the runtime's and driver's launch calls
    kernels = [e for e in events if e.device_type() != cpu and e.duration_ns() > 0 and "Memcpy" not in e.name()
               and "Memset" not in e.name() and not e.name().startswith(MARK) and e.name() != "first-token"]  # not the ranges' GPU spans

    def owner(kernel) -> int | None:
        at = launches.get(kernel.correlation_id())
        if at is None:
            return None
        for group, start, end in flushes:
            if start <= at <= end:
                return group
        return None

    print(f"{torch.cuda.get_device_name() if device == 'cuda' else 'cpu'}, torch {torch.__version__}; {args.pipeline}, "
          f"{args.tokens} tokens: first token {ms(t1):.1f} ms under the profiler, {len(kernels)} kernels")
    by_flush: dict[int | None, list] = {}
    for kernel in kernels:
        by_flush.setdefault(owner(kernel), []).append(kernel)
    print("| flush | host span (ms) | kernels | device first start - last end (ms) | busy (ms) | streams |")
    print("|---|---|---:|---|---:|---|")
    for group, start, end in flushes:
        own = by_flush.get(group, [])
        streams = sorted({k.device_resource_id() for k in own})
        first = min((k.start_ns() for k in own), default=None)
        last = max((k.end_ns() for k in own), default=None)
        spent = sum(b - a for a, b in busy([(k.start_ns(), k.end_ns()) for k in own])) / 1e6
        device_span = f"{ms(first):.1f} - {ms(last):.1f}" if own else "-"
        print(f"| {group} | {ms(start):.1f} - {ms(end):.1f} | {len(own)} | {device_span} | {spent:.1f} | {streams} |")
    forward = by_flush.get(None, [])
    if forward:
        streams = sorted({k.device_resource_id() for k in forward})
        print(f"forward (every kernel outside the flushes, streams {streams}): {len(forward)} kernels, last end "
              f"{ms(max(k.end_ns() for k in forward)):.1f} ms, busy {sum(b - a for a, b in busy([(k.start_ns(), k.end_ns()) for k in forward])) / 1e6:.1f} ms")
    if kernels:
        union = busy([(max(k.start_ns(), t0), min(k.end_ns(), t1)) for k in kernels if k.end_ns() > t0 and k.start_ns() < t1])
        gaps = [(a, b) for (_, a), (b, _) in zip(union, union[1:])] + [(union[-1][1], t1)]
        idle = sum(b - a for a, b in gaps) / 1e6 + (union[0][0] - t0) / 1e6
        print(f"GPU busy {sum(b - a for a, b in union) / 1e6:.1f} ms, idle {idle:.1f} ms (before the first kernel "
              f"{(union[0][0] - t0) / 1e6:.1f} ms, after the last {(t1 - union[-1][1]) / 1e6:.1f} ms)")
        print("| idle gap (ms) | from | the host inside flush |")
        print("|---:|---:|---|")
        for a, b in sorted(gaps, key=lambda g: g[0] - g[1])[:12]:
            inside = [g for g, s, e in flushes if s <= a <= e]
            print(f"| {(b - a) / 1e6:.2f} | {ms(a):.1f} | {inside[0] if inside else '-'} |")


if __name__ == "__main__":
    main()
