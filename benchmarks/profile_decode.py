"""Where a decode step's time goes: ``model.generate`` on the Llama-3-8B-shaped model of ``decode_e2e.py``, a
few steps under ``torch.profiler``, the device time per kernel name and the host time per operation.

    python benchmarks/profile_decode.py [--method kzd-k4v2-f48-d128] [--registry benchmarks/dense_sweep.toml]
        [--batch 64] [--context 65536] [--steps 8] [--top 25] [--shapes] [--memory N [--memory-trace FILE]] [--smoke]

The cache is filled as ``decode_e2e.py`` fills it (``--fill-rows`` rows through the encoder, grown to ``--batch``),
``--warmup`` steps run unprofiled (compiling the kernels), then ``--steps`` steps are profiled; none of them
compresses a block unless ``--steps`` passes a block boundary. Printed: the median step; per CUDA kernel name its
device time per step and share of the step; per host operation its self time per step. ``--smoke``: a tiny model on
the CPU (checks the script; host times only). ``--memory N`` (CUDA): N more steps, each with the memory held after it
and the peak within it; ``--memory-trace FILE`` also writes the allocator's history over them.
"""

from __future__ import annotations

import argparse
import pickle
from collections import defaultdict

import torch

import decode_e2e as e2e  # (which asks the CUDA allocator for expandable segments before anything starts CUDA)


def profiled_generate(model, cache, batch: int, steps: int, device: str, shapes: bool = False):
    clock = e2e.StepClock()
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities, record_shapes=shapes) as prof:
        e2e.generate_steps(model, cache, batch, cache.get_seq_length(), steps, device, clock)
        e2e.sync()
    return prof, clock.times


class MemoryClock(e2e.StepClock):
    """The step clock, also noting the memory held after each step and the peak within it (CUDA)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory: list[tuple[float, float]] = []

    def __call__(self, input_ids, scores, **kwargs):
        done = super().__call__(input_ids, scores, **kwargs)
        self.memory.append((torch.cuda.memory_allocated() / 1e9, torch.cuda.max_memory_allocated() / 1e9))
        torch.cuda.reset_peak_memory_stats()
        return done


def memory_steps(model, cache, batch: int, steps: int, device: str, trace: str | None) -> list[str]:
    """Per step: memory held after it and the peak within it (GB); ``trace``: the allocator's history over these steps
    written there (a pickle of ``torch.cuda.memory._snapshot()``, for https://pytorch.org/memory_viz) and the
    allocations live at its peak printed by source line."""
    clock = MemoryClock()
    if trace:
        torch.cuda.memory._record_memory_history(max_entries=400_000)
    torch.cuda.reset_peak_memory_stats()
    e2e.generate_steps(model, cache, batch, cache.get_seq_length(), steps, device, clock)
    lines = ["| step | held after (GB) | peak within (GB) |", "|---:|---:|---:|"]
    lines += [f"| {i} | {held:.2f} | {peak:.2f} |" for i, (held, peak) in enumerate(clock.memory)]
    if trace:
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        with open(trace, "wb") as handle:
            pickle.dump(snapshot, handle)
        lines += [""] + peak_allocations(snapshot)
    return lines


def peak_allocations(snapshot: dict, top: int = 15) -> list[str]:
    """From an allocator history (``torch.cuda.memory._snapshot()`` with history recorded): the allocations made while
    recording that were live at its highest point, summed by the first kvweave (else transformers, else any) source
    line of their stack."""
    trace = [e for e in snapshot["device_traces"][0] if e["action"] in ("alloc", "free_completed")]
    live, held, best, at = {}, 0, -1, 0
    for i, event in enumerate(trace):
        held += event["size"] if event["action"] == "alloc" else -event["size"]
        if held > best:
            best, at = held, i
    for event in trace[: at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)

    def where(frames: list[dict]) -> str:
        for needle in ("kvweave", "/transformers/", ""):
            for frame in frames:
                if needle in frame["filename"] and "profile_decode" not in frame["filename"]:
                    return f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
        return "?"

    by_line: dict[str, list] = defaultdict(lambda: [0, 0])
    for event in live.values():
        by_line[where(event.get("frames", []))][0] += event["size"]
        by_line[where(event.get("frames", []))][1] += 1
    lines = [f"allocations made in these steps and live at their peak: {best / 1e9:.2f} GB", "",
             "| made at | GB | allocations |", "|---|---:|---:|"]
    for line, (size, count) in sorted(by_line.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| `{line}` | {size / 1e9:.3f} | {count} |")
    return lines


def by_shapes(prof, per: float, device: str, top: int) -> list[str]:
    """The torch operations by their input shapes, the device time of the kernels each launched (CPU: its own host
    time) per step: which call of an operation a kernel's time belongs to (``--shapes``)."""
    rows = []
    for event in prof.key_averages(group_by_input_shape=True):
        spent = event.self_device_time_total if device == "cuda" else event.self_cpu_time_total
        if event.device_type == torch.autograd.DeviceType.CPU and event.key.startswith("aten::") and spent > 0:
            rows.append((spent, event.count, event.key, str(event.input_shapes)[:120]))
    what = "device" if device == "cuda" else "host (self)"
    lines = [f"| operation | input shapes | calls per step | {what} us per step |", "|---|---|---:|---:|"]
    lines += [f"| `{key}` | `{shapes}` | {count / per:.2f} | {spent / per:,.0f} |" for spent, count, key, shapes in sorted(rows, reverse=True)[:top]]
    return lines


def table(rows: list[tuple[str, float, int]], per: float, step_us: float, title: str, top: int) -> list[str]:
    lines = [f"| {title} | calls per step | us per step | share of the median step |", "|---|---:|---:|---:|"]
    for name, total_us, calls in sorted(rows, key=lambda r: -r[1])[:top]:
        lines.append(f"| `{name[:90]}` | {calls / per:.0f} | {total_us / per:,.0f} | {100 * total_us / per / step_us:.1f}% |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="kzd-k4v2-f48-d128")
    parser.add_argument("--registry", default="benchmarks/dense_sweep.toml")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--fill-rows", type=int, default=8)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same head shape on the CPU (checks the script)")
    parser.add_argument("--memory", type=int, default=0, help="CUDA: after the profile, this many more steps with the memory "
                        "held after each and its peak within it")
    parser.add_argument("--shapes", action="store_true", help="also the torch operations by input shapes, with the device "
                        "time of what each launched (e.g. --steps 70 takes in a flush, whose concatenations show here)")
    parser.add_argument("--memory-trace", help="with --memory: write the allocator's history over those steps here (a pickle)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    e2e.REGISTRY = args.registry
    model = e2e.random_model(e2e.smoke_config(args.layers) if args.smoke else e2e.llama3_8b(args.layers), device)
    cache = e2e.make_cache(args.method, model, args.batch, args.context, device, args.fill_rows)
    e2e.decode(model, cache, args.batch, args.context, args.warmup + 1, device)  # compiles; its tokens stay in the cache
    prof, stamps = profiled_generate(model, cache, args.batch, args.steps, device, args.shapes)
    steps = sorted(b - a for a, b in zip(stamps, stamps[1:]))  # the first step builds the mask: left out
    median_us = steps[len(steps) // 2] * 1e6
    per = len(stamps)
    gpu, host = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    for event in prof.key_averages():
        if device == "cuda" and event.device_time_total > 0 and event.device_type == torch.autograd.DeviceType.CUDA:
            gpu[event.key][0] += event.device_time_total
            gpu[event.key][1] += event.count
        if event.self_cpu_time_total > 0:
            host[event.key][0] += event.self_cpu_time_total
            host[event.key][1] += event.count
    print(f"# {args.method}, B = {args.batch}, context {args.context:,}, {per} profiled steps, {device}; median step "
          f"{median_us / 1e3:.1f} ms (under the profiler); stored {e2e.cache_bytes(cache) / 1e9:.2f} GB")
    if gpu:
        device_us = sum(v[0] for v in gpu.values()) / per
        print(f"\ndevice time per step {device_us / 1e3:.1f} ms ({100 * device_us / median_us:.0f}% of the step)\n")
        print("\n".join(table([(k, v[0], v[1]) for k, v in gpu.items()], per, median_us, "CUDA kernel", args.top)))
    print()
    print("\n".join(table([(k, v[0], v[1]) for k, v in host.items()], per, median_us, "host operation (self time)", args.top)))
    if args.shapes:
        print()
        print("\n".join(by_shapes(prof, per, device, args.top)))
    if args.memory and device == "cuda":
        weights = sum(p.nbytes for p in model.parameters()) / 1e9
        print(f"\nmemory: weights {weights:.2f} GB, stored cache {e2e.cache_bytes(cache) / 1e9:.2f} GB\n")
        print("\n".join(memory_steps(model, cache, args.batch, args.memory, device, args.memory_trace)))


if __name__ == "__main__":
    main()
