"""Where a ``lowbit`` decode call's time goes among its programs: the dense kernel's packed pass and the combine, each
program's start, end and SM read from the GPU's timers (:mod:`kvweave.kernels.timeline`), on the storages of
``benchmarks/lowbit_kernel.py``.

    python benchmarks/dense_timeline.py [--storage k4v2e48t] [--tokens 32768,65536] [--batches 1,8,32]
        [--calls 7] [--cold-l2] [--configs dense:64:4:0] [--out DIR]
    python benchmarks/dense_timeline.py --method depthweave-kv [--tokens ...] [--batches ...] [--cold-l2]
    python benchmarks/dense_timeline.py --sm-loads DIR/dense_timeline.json   # a run's SMs by programs run, no GPU

``--method depthweave-kv``: depthweave-kv's tiles pass (``fused_decode``) instead, over a cache filled as
``benchmarks/decode_kernel.py`` fills it; its combine takes no trace, and its slots are the most programs seen running at
once.

Per (T, B) and configuration: ``--calls`` calls recorded (eager, after warm-up and one recorded call that builds the traced kernels; with ``--cold-l2`` each call reads its
own copy of the storage past the L2 cache), the call whose packed pass spans the median reported: its programs and
the programs its SMs hold at once (``slots``, from the launch's registers), the pass's span from its first program's
start to its last one's end, the share of slots x span its programs ran (``busy``), the time until 90% of the slots
ran (``ramp``) and from the last moment they did to the end (``tail``), the programs' median / 90th percentile /
longest time, each wave's median (programs in order of start, ``slots`` at a time), the last program's start; the
combine's first start, its programs' first and last moment past their wait for the pass (``ready``), its end, and
how far its end lies past the pass's; and the call's graph time (20 calls replayed from a CUDA graph, untraced, the
same storage) for scale. Times in microseconds from the pass's first program's start. A table on stdout; JSON (with
each program's start, end and SM) and a plot (slots busy over time, pass and combine; each SM's programs for the first SMs) in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import attrs
import numpy as np
import torch

from decode_kernel import HEAD_DIM, Q_HEADS, first_rows, graph_us, llama3_window_config, read_in_turn
from decode_kernel import view_bytes as decode_bytes
from kvweave.core.registry import load_pipeline
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels.depthweave_decode import fused_decode
from lowbit_kernel import SHAPES, STORAGES, config_name, packed_view, parse_configs, view_bytes
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch
from kvweave.kernels.lowbit_dense import dense_slots, multiprocessors
from kvweave.kernels.timeline import busy, programs, recording, sm_loads, summary

#: the SMs whose programs the plot draws one by one
PLOT_SMS = 8


#: the traced kernel of each method's packed pass and of its combine (None: its combine takes no trace)
TRACED = {"dense": ("_lowbit_dense_kernel", "_combine"), "depthweave-kv": ("_tiles_kernel", None)}


def traced_call(call, method: str = "dense") -> tuple:
    """One call of ``call`` recorded: (packed pass, combine or None) :class:`~kvweave.kernels.timeline.Programs` of
    ``method``'s kernels (:data:`TRACED`)."""
    with recording() as calls:
        call()
    torch.cuda.synchronize()
    packed_name, combine_name = TRACED[method]
    packed = [c for c in calls if c.name == packed_name]
    combine = [c for c in calls if combine_name is not None and combine_name in c.name]
    if len(packed) != 1 or (combine_name is not None and len(combine) != 1):
        raise RuntimeError(f"expected {method}'s packed pass{' and its combine' if combine_name else ''} traced once, "
                           f"got {[c.name for c in calls]}")
    return programs(packed[0].trace), (programs(combine[0].trace) if combine else None)


def recorded_calls(call, count: int, method: str = "dense") -> list[tuple]:
    """``count`` calls of ``call`` recorded (:func:`traced_call`) after three untraced ones and one recorded and left
    out: the traced builds compile in that one, and a call that compiles starts its later launches late."""
    for _ in range(3):
        call()
    traced_call(call, method)
    return [traced_call(call, method) for _ in range(count)]


def program_times(cell: dict) -> dict:
    """The reported call's programs, for the JSON: each one's start and end (microseconds from the pass's first
    program's start, rounded to 10 ns) and SM, the pass's and the combine's."""
    origin = cell["_packed"].start.min()
    return {name: {"start": np.round((progs.start - origin) / 1e3, 2).tolist(),
                   "end": np.round((progs.end - origin) / 1e3, 2).tolist(), "sm": progs.sm.tolist()}
            for name, progs in (("packed", cell["_packed"]), ("combine", cell["_combine"])) if progs is not None}


def plot(cells: list[dict], path: Path) -> None:
    """Per cell: slots busy over time (packed pass, combine) and the first :data:`PLOT_SMS` SMs' programs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cells), 2, figsize=(13, 2.8 * len(cells)), squeeze=False)
    for (busy_ax, sm_ax), cell in zip(axes, cells):
        packed, origin = cell["_packed"], cell["_packed"].start.min()
        traced = [(name, progs) for name, progs in (("packed pass", packed), ("combine", cell["_combine"])) if progs is not None]
        times = np.linspace(0, max(progs.end.max() for _, progs in traced) - origin, 600)
        for name, progs in traced:
            busy_ax.plot(times / 1e3, busy(progs, times + origin), label=name)
        busy_ax.axhline(cell["slots"], color="grey", lw=0.8, ls="--", label="slots")
        busy_ax.set_title(f"{cell['kernel']}, T = {cell['tokens']}, B = {cell['batch']}: programs running", fontsize=9)
        busy_ax.set_xlabel("us from the first program's start")
        busy_ax.legend(fontsize=7)
        jitter = np.random.default_rng(0)  # programs of one SM drawn a little apart
        for row, unit in enumerate(np.unique(packed.sm)[:PLOT_SMS]):
            for (_, progs), colour in zip(traced, ("tab:blue", "tab:orange")):
                on = progs.sm == unit
                for s, e in zip(progs.start[on] - origin, progs.end[on] - origin):
                    sm_ax.plot([s / 1e3, e / 1e3], [row + jitter.uniform(-0.35, 0.35)] * 2, color=colour, lw=1.2)
        sm_ax.set_title("programs of the first SMs (blue: packed pass, orange: combine)", fontsize=9)
        sm_ax.set_xlabel("us from the first program's start")
        sm_ax.set_ylabel("SM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def reported(tokens: int, batch: int, name: str, slots: int, records: list, graph: float) -> dict:
    """A cell from its recorded calls (the one whose packed pass spans the median), printed as a table row."""
    spans = [p.end.max() - p.start.min() for p, _ in records]
    packed, combine = records[int(np.argsort(spans)[len(spans) // 2])]
    found = summary(packed, slots, combine)
    c = found.get("combine")
    waves = " / ".join(f"{w:.1f}" for w in found["waves"])
    combined = (f"{c['start']:.1f} / {c['ready_first']:.1f}-{c['ready_last']:.1f} / {c['end']:.1f} ({c['after']:+.1f})"
                if c else "not traced")
    print(f"| {tokens} | {batch} | {name} | {found['programs']} / {slots} | {found['span']:.1f} | "
          f"{100 * found['busy_share']:.0f}% | {found['ramp']:.1f} | {found['tail']:.1f} | "
          f"{found['median']:.1f} / {found['p90']:.1f} / {found['longest']:.1f} | {waves} | "
          f"{found['last_start']:.1f} | {combined} | {graph:.1f} |", flush=True)
    return {"tokens": tokens, "batch": batch, "kernel": name, "slots": slots, "graph_us": graph,
            "spans_us": [s / 1e3 for s in spans], **found, "_packed": packed, "_combine": combine}


def depthweave_cells(tokens: int, batches: list[int], calls: int, cold: bool) -> list[dict]:
    """depthweave-kv's tiles pass at ``tokens`` for each of ``batches``: a cache of the largest batch filled as
    ``benchmarks/decode_kernel.py`` fills it (layer 1's view, its first rows for the smaller batches), ``calls`` calls
    of ``fused_decode`` recorded. The slots (programs its SMs hold at once) are the most programs seen running at once
    in any recorded call: its launch states no count."""
    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, max(batches), tokens, chunk=8192, device="cuda", seed=tokens)
    full = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
    cells = []
    for batch in batches:
        view = full if batch == max(batches) else first_rows(full, batch)
        views = read_in_turn(view, decode_bytes(view), cold)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        call = lambda: fused_decode(views(), q, None, HEAD_DIM ** -0.5)  # noqa: E731
        records = recorded_calls(call, calls, "depthweave-kv")
        slots = max(int(busy(p, np.sort(p.start)).max()) for p, _ in records)
        cells.append(reported(tokens, batch, "depthweave-kv tiles", slots, records, graph_us(call, 10)))
        del views
    del cache, full
    torch.cuda.empty_cache()
    return cells


def print_sm_loads(path: Path) -> None:
    """Each cell of a ``dense_timeline.json``: its packed pass's SMs by programs run (:func:`sm_loads`), a table."""
    rows = json.loads(path.read_text())["rows"]
    print("| T | B | kernel | programs an SM | SMs | program median / p90 (us) | last end (us) |")
    print("|---:|---:|---|---:|---:|---|---:|")
    for row in rows:
        times = row["program_times"]["packed"]
        for load in sm_loads(times["start"], times["end"], times["sm"]):
            print(f"| {row['tokens']} | {row['batch']} | {row['kernel']} | {load['programs']} | {load['sms']} | "
                  f"{load['median']:.1f} / {load['p90']:.1f} | {load['last_end']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--storage", default="k4v2e48t", choices=list(STORAGES))
    parser.add_argument("--tokens", default="32768,65536")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--configs", default="dense:64:4:0", help="as benchmarks/lowbit_kernel.py's")
    parser.add_argument("--calls", type=int, default=7, help="calls recorded a cell; the median pass's reported")
    parser.add_argument("--post-rope", action="store_true", default=True, help="keys stored after RoPE (the default)")
    parser.add_argument("--pre-rope", dest="post_rope", action="store_false", help="keys stored before RoPE")
    parser.add_argument("--cold-l2", action="store_true", help="each call reads its own copy past the L2 cache")
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES))
    parser.add_argument("--method", default="dense", choices=list(TRACED),
                        help="dense: the lowbit dense kernel over --storage; depthweave-kv: its tiles pass over a cache "
                             "filled as benchmarks/decode_kernel.py fills it (Llama-3-8B shape; --storage, --configs and "
                             "--shape unused)")
    parser.add_argument("--out", default="results/dense_timeline")
    parser.add_argument("--sm-loads", metavar="JSON", help="print, from a run's dense_timeline.json, each cell's SMs "
                        "grouped by how many of its pass's programs they ran, and exit (no GPU)")
    args = parser.parse_args()
    if args.sm_loads:
        print_sm_loads(Path(args.sm_loads))
        return
    if not torch.cuda.is_available():
        raise SystemExit("dense_timeline.py reads the GPU's timers; run it on a GPU machine")
    if args.calls < 1:
        raise SystemExit(f"--calls must be at least 1, got {args.calls}")
    q_heads, _, dim, _ = SHAPES[args.shape]
    configs = [(v, b, w, p or None, t) for v, b, w, p, t in parse_configs(args.configs, 0)]
    sms = multiprocessors(torch.device("cuda"))
    scale = dim ** -0.5
    cells = []
    what = "depthweave-kv" if args.method == "depthweave-kv" else f"storage {args.storage}{'' if args.post_rope else ' (pre-RoPE keys)'}"
    print(f"{torch.cuda.get_device_name()}, {sms} SMs; {what}"
          f"{', every call its own copy past the L2 cache' if args.cold_l2 else ''}")
    print("\n| T | B | kernel | programs / slots | span | busy | ramp | tail | program: median / p90 / longest | waves' medians "
          "| last start | combine: start / ready first-last / end (after the pass) | graph us |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---|---|---:|---|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        if args.method == "depthweave-kv":
            cells += depthweave_cells(tokens, [int(b) for b in args.batches.split(",")], args.calls, args.cold_l2)
            continue
        for batch in (int(b) for b in args.batches.split(",")):
            view = packed_view(batch, tokens, storage=args.storage, shape=args.shape)
            if args.post_rope:
                view = attrs.evolve(view, inv_freq=None)
            q = torch.randn(batch, q_heads, dim, device="cuda", dtype=torch.bfloat16)
            views = read_in_turn(view, view_bytes(view), args.cold_l2)
            for variant, block, warps, progs, tricks in configs:
                name = config_name(variant, block, warps, progs, tricks)
                call = lambda: lowbit_decode(views(), q, None, scale, block, warps, variant, progs, tricks)  # noqa: E731
                launch = plan_launch(view, q, None, scale, block, warps, variant, progs, tricks=tricks)
                slots = dense_slots(sms, dim, launch.constants["HID"] > 0, warps, launch.constants.get("maxnreg"))
                records = recorded_calls(call, args.calls)
                cells.append(reported(tokens, batch, name, slots, records, graph_us(call, 10)))
            del view, views
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot(cells, out / "dense_timeline.png")
    stamp = datetime.date.today().isoformat()
    rows = [{k: v for k, v in cell.items() if not k.startswith("_")} | {"program_times": program_times(cell)}
            for cell in cells]
    (out / "dense_timeline.json").write_text(json.dumps({"date": stamp, "device": torch.cuda.get_device_name(), "sms": sms,
                                                         "method": args.method, "storage": args.storage, "cold_l2": args.cold_l2,
                                                         "post_rope": args.post_rope, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
