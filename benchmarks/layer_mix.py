"""A pipeline whose layers store different kinds of layer, against the kernel bars: ``benchmarks/lowbit_kernel.py``
times one kind of layer a run (``--storage``); this weighs the runs' cells by how many layers of each kind the
pipeline has, as a decode step reads every layer once: its time a step is the sum of its layers', its bytes too.

    python benchmarks/layer_mix.py results/v2/lowbit_kernel.json:22 results/v4/lowbit_kernel.json:8

(``benchmarks/dense_sweep.toml``'s kzd-k4vq25-f40: 22 of its 30 layers ``k4v2e40t``, 8 ``k4v4e40t``). Prints, for each
(tokens, batch, kernel) cell that every run has, the pipeline's speed-up over SDPA over the full bfloat16 cache (graph
time and GPU time), its bytes ratio, the bar (0.7 x the bytes ratio) and its share of copy bandwidth. The runs must
share the attention shape and the device, and should come from one lease."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

#: the kernel bar: at least this times the bytes ratio faster than SDPA over the full cache
BAR_SHARE = 0.7
#: the other kernel bar: at least this share of copy bandwidth on the bytes read
BANDWIDTH_BAR = 0.7


def parse_part(text: str) -> tuple[Path, int]:
    """``PATH:LAYERS`` -> (path, layers), with errors that name the argument."""
    path, sep, count = text.rpartition(":")
    if not sep or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"layer_mix.py: {text!r}: expected PATH:LAYERS, LAYERS a whole number of at least 1")
    return Path(path), int(count)


def load_run(path: Path) -> dict:
    try:
        run = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"layer_mix.py: {path}: not a readable lowbit_kernel.json ({err})") from err
    if not isinstance(run, dict) or "rows" not in run or "copy_bandwidth" not in run:
        raise SystemExit(f"layer_mix.py: {path}: not a lowbit_kernel.json (no 'rows' or 'copy_bandwidth')")
    return run


def mix(runs: list[tuple[dict, int]]) -> list[dict]:
    """The pipeline's cells: each run's cells weighed by its layer count (``runs``: (lowbit_kernel.json's content,
    layers of that kind)). Only cells every run has; the full cache's bytes of a layer (``bytes_read`` x
    ``bytes_ratio``) must agree between runs."""
    shapes = {run.get("shape") for run, _ in runs}
    devices = {run.get("device") for run, _ in runs}
    if len(shapes) > 1 or len(devices) > 1:
        raise SystemExit(f"layer_mix.py: the runs differ in attention shape {sorted(map(str, shapes))} or device "
                         f"{sorted(map(str, devices))}; weigh runs of one shape on one device")
    cells = [{(row["tokens"], row["batch"], row["kernel"]): row for row in run["rows"]} for run, _ in runs]
    common = [key for key in cells[0] if all(key in other for other in cells[1:])]
    if not common:
        raise SystemExit("layer_mix.py: the runs have no (tokens, batch, kernel) cell in common")
    layers = sum(count for _, count in runs)
    out = []
    for key in common:
        rows = [(c[key], count, run) for c, (run, count) in zip(cells, runs)]
        full = {round(row["bytes_read"] * row["bytes_ratio"]) for row, _, _ in rows}
        if max(full) - min(full) > 1e-6 * max(full):
            raise SystemExit(f"layer_mix.py: cell T = {key[0]}, B = {key[1]}: the runs' full caches differ ({sorted(full)} "
                             "bytes): not the same attention shape")
        weigh = lambda field: sum(row[field] * count for row, count, _ in rows) / layers  # noqa: E731 - a layer's mean
        read = weigh("bytes_read")
        kernel, graph, sdpa, sdpa_graph = weigh("kernel_us"), weigh("graph_us"), weigh("sdpa_us"), weigh("sdpa_graph_us")
        bandwidth = sum(run["copy_bandwidth"] * count for _, count, run in rows) / layers
        ratio = max(full) / read
        out.append({"tokens": key[0], "batch": key[1], "kernel": key[2], "sdpa_graph_us": sdpa_graph,
                    "graph_us": graph, "graph_speedup": sdpa_graph / graph, "sdpa_us": sdpa,
                    "kernel_us": kernel, "speedup": sdpa / kernel, "bytes_read": read, "bytes_ratio": ratio,
                    "bar": BAR_SHARE * ratio, "of_copy": read / (kernel * 1e-6) / bandwidth,
                    "of_copy_graph": read / (graph * 1e-6) / bandwidth})
    return out


def table(cells: list[dict], graph: bool = False) -> str:
    """The cells as a table; the share of copy bandwidth (and so the bandwidth bar) from the GPU time, or with
    ``graph`` from the graph time, as ``benchmarks/kernel_plot.py --graph`` takes it."""
    lines = ["| T | B | kernel | SDPA / pipeline us a layer (graph) | speed-up (graph) | speed-up (GPU) | bytes ratio | "
             f"bar | % of copy bw ({'graph' if graph else 'GPU'}) | both bars |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for c in cells:
        share = c["of_copy_graph"] if graph else c["of_copy"]
        met = c["graph_speedup"] >= c["bar"] and share >= BANDWIDTH_BAR
        lines.append(f"| {c['tokens']} | {c['batch']} | {c['kernel']} | {c['sdpa_graph_us']:.1f} / {c['graph_us']:.1f} | "
                     f"{c['graph_speedup']:.2f}x | {c['speedup']:.2f}x | {c['bytes_ratio']:.2f}x | {c['bar']:.2f}x | "
                     f"{100 * share:.0f}% | {'met' if met else 'missed'} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("parts", nargs="+", help="PATH:LAYERS, PATH a lowbit_kernel.json, LAYERS the pipeline's layers "
                        "of that kind")
    parser.add_argument("--graph", action="store_true", help="the share of copy bandwidth from the graph time (as "
                        "kernel_plot.py --graph), not the GPU time")
    args = parser.parse_args()
    runs = [(load_run(path), count) for path, count in map(parse_part, args.parts)]
    label = " + ".join(f"{count} x {run.get('storage')}" for run, count in runs)
    print(f"{label} ({runs[0][0].get('device')}, {runs[0][0].get('date')})\n")
    print(table(mix(runs), args.graph))


if __name__ == "__main__":
    main()
