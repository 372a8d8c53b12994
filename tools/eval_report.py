"""The outputs of ``kvweave eval`` built from task results: needle heatmaps, the per-layer fidelity plot,
the quality-vs-memory plot, and the table (Markdown, CSV, JSON). Nothing here runs a model."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvweave.tools.eval_folder import RunFolder


# ------------------------------------------------------------------------------------------ plots
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def needle_heatmap(path: Path, name: str, grid: list[list[float]], lengths: list[int], depths: list[float], count: int, model: str) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(1.2 + 1.1 * len(lengths), 1.2 + 0.6 * len(depths)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0.0, vmax=1.0, aspect="auto")
    ax.set_xticks(range(len(lengths)), [f"{n:,}" for n in lengths])
    ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("needle depth")
    for i, row in enumerate(grid):
        for j, value in enumerate(row):
            ax.text(j, i, "-" if math.isnan(value) else f"{value:.2f}", ha="center", va="center", fontsize=8)
    ax.set_title(f"{name}: needle retrieval ({count} needles/cell)\n{model}", fontsize=9)
    fig.colorbar(image, ax=ax, fraction=0.05)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fidelity_plot(path: Path, result: dict[str, Any], model: str) -> None:
    rows = {n: r for n, r in result["pipelines"].items() if "per_layer" in r}
    if not rows:
        return
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, row in rows.items():
        ax.plot(range(len(row["per_layer"])), row["per_layer"], marker=".", label=f"{name} (mean {row['error']:.3f})")
    ax.set_xlabel("layer")
    ax.set_ylabel("attention-output relative error (Eq. 3)")
    ax.set_title(f"Attention-output error per layer, {result['tokens']:,} tokens, {model}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def quality_memory_plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """One panel per quality measure present, x = reduction against 16 bits, one labelled point per pipeline."""
    panels = [(k, label) for k, label in (("needle", "needle accuracy"), ("qa_f1", "QA F1 (mean of datasets)"),
                                          ("ppl", "perplexity"), ("fidelity", "attention-output error"))
              if any(isinstance(r.get(k), float) and not math.isnan(r[k]) for r in rows)]
    points = [r for r in rows if isinstance(r.get("ratio"), float)]
    if not panels or not points:
        return
    plt = _pyplot()
    columns = min(2, len(panels))
    rows_count = math.ceil(len(panels) / columns)
    fig, axes = plt.subplots(rows_count, columns, figsize=(5.2 * columns, 4.0 * rows_count), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (field, label) in zip(axes.flat, panels):
        for row in points:
            value = row.get(field)
            if isinstance(value, float) and not math.isnan(value):
                ax.scatter(row["ratio"], value, s=24)
                ax.annotate(row["pipeline"], (row["ratio"], value), fontsize=6, xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV reduction vs 16-bit (x, stored bytes)")
        ax.set_ylabel(label)
        if field == "ppl":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# ------------------------------------------------------------------------------------------ table
def table_rows(pipelines: list[str], errors: dict[str, str], results: dict[str, dict[str, Any]],
               dtype: str | None = None) -> list[dict[str, Any]]:
    """A row per pipeline. ``ratio`` is against a 16-bit cache of the same tokens; a run in float32 (``dtype``)
    also gets ``ratio_float32``, against the float32 cache the model itself keeps (twice the bytes)."""
    rows = []
    for name in pipelines:
        row: dict[str, Any] = {"pipeline": name}
        if name in errors:
            row["error"] = errors[name]
            rows.append(row)
            continue
        for task in ("ppl", "fidelity", "speed"):  # bytes from the first of these that ran (ppl: the cache filled chunk by chunk)
            data = results.get(task, {}).get("pipelines", {}).get(name, {})
            if "stored_bytes" in data and "bytes" not in row:
                row["bytes"], row["ratio"] = data["stored_bytes"], data["full_16bit_bytes"] / data["stored_bytes"]
                if dtype == "float32":
                    row["ratio_float32"] = 2 * row["ratio"]
                row["bytes_from"] = task
        needle = results.get("needle", {}).get("pipelines", {}).get(name, {})
        if "accuracy" in needle:
            row["needle"] = needle["accuracy"]
        qa = results.get("qa", {}).get("pipelines", {}).get(name, {})
        f1s = []
        for dataset in results.get("qa", {}).get("datasets", []):
            if dataset in qa:
                row[f"{dataset}_em"], row[f"{dataset}_f1"] = qa[dataset]["em"], qa[dataset]["f1"]
                f1s.append(qa[dataset]["f1"])
        if f1s:
            row["qa_f1"] = sum(f1s) / len(f1s)
        ppl = results.get("ppl", {}).get("pipelines", {}).get(name, {})
        if "ppl" in ppl:
            row["ppl"], row["ppl_delta"] = ppl["ppl"], ppl["ppl_delta"]
        fidelity = results.get("fidelity", {}).get("pipelines", {}).get(name, {})
        if "error" in fidelity and isinstance(fidelity["error"], float):
            row["fidelity"] = fidelity["error"]
        speed = results.get("speed", {}).get("pipelines", {}).get(name, {})
        if "ttft_seconds" in speed:
            row["ttft"], row["decode_tps"] = speed["ttft_seconds"], speed["decode_tokens_per_second"]
            if "peak_extra_bytes" in speed:
                row["peak_extra_bytes"] = speed["peak_extra_bytes"]
            if "decoded" in speed:  # --speed-cuda-graphs
                row["decoded"] = speed["decoded"]
        rows.append(row)
    return rows


def _columns(rows: list[dict[str, Any]], datasets_run: list[str], base: str | None) -> list[tuple[str, str, Callable[[Any], str]]]:
    pct = lambda v: f"{100 * v:.1f}"  # noqa: E731
    num = lambda v: f"{v:.3f}"  # noqa: E731
    columns: list[tuple[str, str, Callable[[Any], str]]] = [
        ("bytes", "KV bytes", lambda v: f"{v:,}"), ("ratio", "reduction", lambda v: f"{v:.2f}x"),
        ("ratio_float32", "vs float32 cache", lambda v: f"{v:.2f}x"), ("needle", "needle acc %", pct),
    ]
    for dataset in datasets_run:
        label = {"hotpotqa": "HotpotQA", "squad": "SQuAD"}.get(dataset, dataset)
        columns += [(f"{dataset}_em", f"{label} EM", pct), (f"{dataset}_f1", f"{label} F1", pct)]
    columns += [("ppl", "ppl", num), ("ppl_delta", "Δppl", lambda v: f"{v:+.3f}"), ("fidelity", "attn-out err", lambda v: f"{v:.4f}"),
                ("ttft", "TTFT s", lambda v: f"{v:.2f}"), ("decode_tps", "decode tok/s", lambda v: f"{v:.1f}"),
                ("peak_extra_bytes", "peak extra MB", lambda v: f"{v / 1e6:,.1f}"), ("decoded", "decoded", str)]
    if base is not None:
        columns.insert(4, ("needle_vs_base", f"Δ needle vs {base}", lambda v: f"{100 * v:+.1f}"))
        columns.insert(5 + 2 * len(datasets_run), ("qa_f1_vs_base", f"Δ QA F1 vs {base}", lambda v: f"{100 * v:+.1f}"))
    return [c for c in columns if any(c[0] in r for r in rows)]


def render_table(rows: list[dict[str, Any]], datasets_run: list[str], base: str | None = None) -> tuple[str, str]:
    """The Markdown table and the CSV text of ``rows``."""
    if base is not None:
        anchor = next((r for r in rows if r["pipeline"] == base), {})
        for row in rows:
            for field, target in (("needle", "needle_vs_base"), ("qa_f1", "qa_f1_vs_base")):
                if field in row and field in anchor:
                    row[target] = row[field] - anchor[field]
    columns = _columns(rows, datasets_run, base)
    lines = ["| pipeline | " + " | ".join(c[1] for c in columns) + " |", "|---|" + "---:|" * len(columns)]
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(["pipeline", *(c[0] for c in columns), "error"])
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['pipeline']} | " + " | ".join(["—"] * len(columns)) + f" |  \n*{row['pipeline']}: {row['error'][:160]}*")
        else:
            lines.append(f"| {row['pipeline']} | " + " | ".join(c[2](row[c[0]]) if c[0] in row else "—" for c in columns) + " |")
        writer.writerow([row["pipeline"], *(row.get(c[0], "") for c in columns), row.get("error", "")])
    return "\n".join(lines) + "\n", buffer.getvalue()


def write_table(run: RunFolder, pipelines: list[str], errors: dict[str, str], results: dict[str, dict[str, Any]],
                base: str | None, label: str) -> str:
    """table.md (the command and environment of each session on top), table.csv, table.json and
    quality_vs_memory.png in the run folder; returns the Markdown table."""
    rows = table_rows(pipelines, errors, results, run.settings.get("dtype"))
    datasets_run = results.get("qa", {}).get("datasets", [])
    markdown, text = render_table(rows, datasets_run, base)
    lines = [_session_line(session) for session in run.record.get("sessions", [])]
    header = (f"Model {label}, {run.settings.get('dtype', 'dtype unknown')}, seed {run.settings.get('seed', 'unknown')}. "
              "Sessions of this run:\n\n" + "\n".join(lines) + "\n\n")
    notes = _notes(results) + ratio_note(rows)
    (run.path / "table.md").write_text(header + markdown + notes, encoding="utf-8")
    (run.path / "table.csv").write_text(text, encoding="utf-8")
    run.write_json("table.json", rows)
    title = f"{'Ablations of ' + base if base else 'Pipelines'}: quality vs memory, {label}"
    quality_memory_plot(run.path / "quality_vs_memory.png", rows, title)
    return markdown


def ratio_note(rows: list[dict[str, Any]]) -> str:
    """The line under a table with a ``vs float32 cache`` column saying what each reduction is against."""
    if not any("ratio_float32" in row for row in rows):
        return ""
    return ("- reduction: stored bytes against a 16-bit cache of the same tokens; vs float32 cache: against the "
            "float32 cache this run's model keeps (its exact window is stored in float32 too)\n")


def _session_line(session: Any) -> str:
    """One session of ``settings.json`` as a Markdown list item (what a hand-edited record lacks shows as "unknown")."""
    if not isinstance(session, dict):
        return f"- session record {session!r} (not an object)"
    versions = session.get("versions") if isinstance(session.get("versions"), dict) else {}
    commit = str(session.get("git_commit") or "unknown")[:10] + (" (modified)" if session.get("git_dirty") else "")
    return (f"- `{session.get('command', 'command unknown')}`  \n  {session.get('started', 'date unknown')}; "
            f"{session.get('hardware', 'hardware unknown')}; kvweave commit {commit}; "
            f"torch {versions.get('torch', 'unknown')}, transformers {versions.get('transformers', 'unknown')}")


_NOTES: dict[str, Callable[[dict[str, Any]], str]] = {
    "needle": lambda r: f"needle: {len(r['needles'])} needles x lengths {r['lengths']} x depths {r['depths']}, "
                        "hit = expected value in the greedy answer",
    "qa": lambda r: f"QA: {r['samples']} questions per dataset, contexts padded with distractors to {r['length']} tokens; "
                    "EM/F1 as SQuAD/HotpotQA define them",
    "ppl": lambda r: f"ppl: {r['tokens']} essay tokens in {r['chunk']}-token chunks; DynamicCache "
                     + ("not run" if r["dynamic_cache_ppl"] is None else f"{r['dynamic_cache_ppl']:.3f}"),
    "fidelity": lambda r: f"attn-out err: Eq. (3), last {r['probe']} positions' queries after {r['tokens']} tokens, "
                          "mean over layers and KV heads",
    "speed": lambda r: f"speed: one generation from {r['tokens']} tokens, {r['new_tokens']} new tokens, batch 1",
}


def _notes(results: dict[str, dict[str, Any]]) -> str:
    parts = [note(results[task]) for task, note in _NOTES.items() if task in results]
    return "\n" + "\n".join(f"- {p}" for p in parts) + "\n" if parts else ""
