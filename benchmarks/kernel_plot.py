"""The decode kernel against the bar, as a plot and a table: from ``benchmarks/lowbit_kernel.py``'s JSON files.

    python benchmarks/kernel_plot.py [LABEL=]RESULTS.json[@KERNEL] [...] [--out PNG] [--fraction 0.7] [--bandwidth 0.7] [--graph]

Each file is what one ``lowbit_kernel.py --out DIR`` run wrote (``DIR/lowbit_kernel.json``); ``LABEL`` names its storage
(default: the file's ``storage`` field, which runs since 2026-12-04 write, else its folder's name); ``@KERNEL`` keeps
the rows of one of the run's ``--configs`` (as the rows name it, e.g. ``dense:64:4:auto:r128``), so that one file's
configurations can be lines of their own. Files with the same
label are one storage measured in parts (e.g. ``--tokens 65536 --batches 128`` apart). Left: the kernel's speed-up over
SDPA on a full bfloat16 cache against the batch, one line per context length, and the bar of docs/kernels.md (speed-up
at least ``--fraction`` times the bytes ratio; dashed, one per storage). Right: the share of the copy bandwidth the
kernel reaches on the bytes it reads, and the ``--bandwidth`` bar. ``--graph``: both from the calls' time replayed
from a CUDA graph, against SDPA's the same way (the runs since 2026-12-05, night, write it: a combine launched before the
packed pass ends overlaps it, which the profiler's per-kernel sum counts twice). The table on stdout says per row
whether each bar is met. The plot needs matplotlib; the table does not.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


GRAPH_FIELDS = {"graph_us", "graph_speedup", "bytes_read"}


def parse_spec(spec: str) -> tuple[str, str, str]:
    """``[LABEL=]PATH[@KERNEL]`` as (label, path, kernel), "" where one is not given."""
    label, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
    path, _, kernel = path.partition("@")
    return label, path, kernel


def load(specs: list[str], graph: bool = False) -> dict[str, list[dict]]:
    """Rows by storage label from ``[LABEL=]PATH`` specs; a file that is not a lowbit_kernel.py result is refused, and
    with ``graph`` one without graph times (or its copy bandwidth). With ``graph`` each row's ``speedup`` and
    ``of_copy`` become the graph time's."""
    storages: dict[str, list[dict]] = {}
    for spec in specs:
        label, path, kernel = parse_spec(spec)
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"kernel_plot.py: cannot read {path}: {error}")
        rows = data.get("rows") if isinstance(data, dict) else None
        needed = {"tokens", "batch", "speedup", "of_copy", "bytes_ratio"}
        if not rows or any(not needed <= set(row) for row in rows):
            raise SystemExit(f"kernel_plot.py: {path} holds no lowbit_kernel.py rows (each needs {', '.join(sorted(needed))})")
        if kernel:
            found = sorted({str(row.get("kernel")) for row in rows})
            rows = [row for row in rows if row.get("kernel") == kernel]
            if not rows:
                raise SystemExit(f"kernel_plot.py: {path} holds no rows of kernel {kernel!r} (it holds {', '.join(found)})")
        if graph:
            if any(not GRAPH_FIELDS <= set(row) for row in rows) or not data.get("copy_bandwidth"):
                raise SystemExit(f"kernel_plot.py: {path} holds no graph times (a lowbit_kernel.py run before 2026-12-05, "
                                 f"night); plot it without --graph")
            rows = [{**row, "speedup": row["graph_speedup"],
                     "of_copy": row["bytes_read"] / (row["graph_us"] * 1e-6) / data["copy_bandwidth"]} for row in rows]
        name = label or data.get("storage") or Path(path).resolve().parent.name
        storages.setdefault(name, []).extend(rows)
    return storages


def table(storages: dict[str, list[dict]], fraction: float, bandwidth: float) -> list[dict]:
    """One line per storage, context length and batch: speed-up, its bar, share of copy bandwidth, and whether each is
    met."""
    lines = []
    for name, rows in storages.items():
        for row in sorted(rows, key=lambda r: (r["tokens"], r["batch"])):
            bar = fraction * row["bytes_ratio"]
            lines.append({"storage": name, "tokens": row["tokens"], "batch": row["batch"], "speedup": row["speedup"],
                          "bar": bar, "of_copy": row["of_copy"], "speed_met": row["speedup"] >= bar,
                          "bandwidth_met": row["of_copy"] >= bandwidth})
    return lines


def plot(lines: list[dict], out: Path, fraction: float, bandwidth: float, graph: bool = False) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (speed, share) = plt.subplots(1, 2, figsize=(12, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = list(dict.fromkeys(line["storage"] for line in lines))
    for index, name in enumerate(names):
        colour = colours[index % len(colours)]
        mine = [line for line in lines if line["storage"] == name]
        for marker, tokens in zip("os^vD", sorted({line["tokens"] for line in mine})):
            points = [line for line in mine if line["tokens"] == tokens]
            batches = [line["batch"] for line in points]
            label = f"{name}, {tokens // 1024}K"
            speed.plot(batches, [line["speedup"] for line in points], marker=marker, color=colour, label=label)
            share.plot(batches, [100 * line["of_copy"] for line in points], marker=marker, color=colour, label=label)
        speed.axhline(mine[0]["bar"], color=colour, linestyle="--", linewidth=1)
        speed.annotate(f"bar {mine[0]['bar']:.1f}x", (1, mine[0]["bar"]), color=colour, fontsize=8,
                       textcoords="offset points", xytext=(2, 3))
    share.axhline(100 * bandwidth, color="grey", linestyle="--", linewidth=1)
    share.annotate(f"bar {100 * bandwidth:.0f}%", (1, 100 * bandwidth), color="grey", fontsize=8, textcoords="offset points",
                   xytext=(2, 3))
    batches = sorted({line["batch"] for line in lines})
    for ax, what in ((speed, "speed-up over SDPA (full bf16 cache)"), (share, "% of copy bandwidth on the bytes read")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(batch) for batch in batches])
        ax.minorticks_off()
        ax.set_xlabel("batch rows")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    timed = "calls replayed from a CUDA graph" if graph else "device time"
    speed.set_title(f"speed-up ({timed}); dashed: {fraction:g} x the bytes ratio", fontsize=10)
    share.set_title("memory bandwidth reached")
    share.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="[LABEL=]PATH[@KERNEL] of a lowbit_kernel.json (@KERNEL: one "
                        "configuration's rows)")
    parser.add_argument("--out", type=Path, default=None, help="plot file (default: beside the first file, kernel.png)")
    parser.add_argument("--fraction", type=float, default=0.7, help="the speed bar as a share of the bytes ratio")
    parser.add_argument("--bandwidth", type=float, default=0.7, help="the bandwidth bar as a share of the copy bandwidth")
    parser.add_argument("--graph", action="store_true", help="speed-up and bandwidth from the calls' graph time")
    args = parser.parse_args(argv)
    if not 0 < args.fraction <= 1 or not 0 < args.bandwidth <= 1:
        raise SystemExit(f"kernel_plot.py: --fraction and --bandwidth are shares in (0, 1], got {args.fraction} and {args.bandwidth}")
    lines = table(load(args.results, args.graph), args.fraction, args.bandwidth)
    print("| storage | T | B | speed-up | bar | met | % of copy bandwidth | met |")
    print("|---|---:|---:|---:|---:|---|---:|---|")
    for line in lines:
        print(f"| {line['storage']} | {line['tokens']} | {line['batch']} | {line['speedup']:.2f}x | {line['bar']:.2f}x | "
              f"{'yes' if line['speed_met'] else 'no'} | {100 * line['of_copy']:.0f}% | {'yes' if line['bandwidth_met'] else 'no'} |")
    out = args.out or Path(parse_spec(args.results[0])[1]).resolve().parent / "kernel.png"
    plot(lines, out, args.fraction, args.bandwidth, args.graph)
    print(f"plot: {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
