"""The quality-at-ratio frontier from an evaluation's needle.json and ppl.json: a markdown table and a plot.

    python benchmarks/frontier_plot.py RESULTS_FOLDER [RESULTS_FOLDER ...] [--out PNG] [--intervals] [--misses] [--common]

RESULTS_FOLDER holds ``needle.json`` (``kvweave eval needle``) and optionally ``ppl.json`` (``kvweave eval
ppl``). Several folders (one grid run in parts, or earlier runs of the same grid) are merged: each
pipeline is taken from the first folder that has it, and their needle grids must be the same. Per pipeline and context length: needles found, found of what the full cache finds (the cells
``full`` answered), and the real stored-bytes ratio against a 16-bit cache; perplexity against the
DynamicCache reference. Perplexity runs merge when they share the protocol (tokens, chunk, prefill); a run whose full
cache measured another perplexity (another device or dtype) joins with each of its pipelines' changes taken against
its own full cache, said on stderr. ``--intervals`` adds the 95% Wilson interval of each "of full" share (how far a grid of
this size can tell two pipelines apart); ``--misses`` lists, per pipeline, the cells the full cache answers and the
pipeline does not, as (length, depth, needle). ``--common`` counts only the cells every pipeline ran (folders grown to
different needle counts, or a run cut short, compared on the same cases).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path


def wilson(found: int, cases: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a share ``found / cases`` (95% for z = 1.96); (0, 1) without cases."""
    if cases <= 0:
        return 0.0, 1.0
    share = found / cases
    centre = (share + z * z / (2 * cases)) / (1 + z * z / cases)
    half = z * math.sqrt(share * (1 - share) / cases + z * z / (4 * cases * cases)) / (1 + z * z / cases)
    return max(0.0, centre - half), min(1.0, centre + half)


def cell(answer: dict) -> tuple:
    return answer["length"], answer["depth"], answer["needle"]


def full_ppl(ppl: dict | None, name: str) -> float | None:
    """The full cache's perplexity that ``name``'s is compared with: its own run's where runs were merged."""
    entry = (ppl or {}).get("pipelines", {}).get(name, {})
    return entry.get("reference", (ppl or {}).get("dynamic_cache_ppl"))


def rows(needle: dict, ppl: dict | None, common: bool = False) -> list[dict]:
    """One row per pipeline: per length hits, cases, of-full counts and the bytes ratio; perplexity change.

    ``common``: only the cells that every pipeline with answers ran."""
    ran = [{cell(r) for r in data["answers"]} for data in needle["pipelines"].values() if "answers" in data]
    keep = set.intersection(*ran) if common and ran else None
    if keep is not None and not keep:
        raise SystemExit("frontier_plot: --common: the pipelines share no cell")
    full = [r for r in needle["pipelines"].get("full", {}).get("answers", []) if keep is None or cell(r) in keep]
    found = {cell(r) for r in full if r["hit"]}
    table = []
    for name, data in needle["pipelines"].items():
        if "answers" not in data:
            continue
        row = {"pipeline": name, "lengths": {}}
        for length in needle["lengths"]:
            cells = [r for r in data["answers"] if r["length"] == length and (keep is None or cell(r) in keep)]
            of_full = [r for r in cells if cell(r) in found]
            row["lengths"][length] = {
                "hits": sum(r["hit"] for r in cells), "cases": len(cells),
                "of_full": sum(r["hit"] for r in of_full), "full_found": len(of_full),
                "missed": sorted((r["length"], r["depth"], r["needle"]) for r in of_full if not r["hit"]),
                "ratio": sum(r["full_16bit_bytes"] for r in cells) / sum(r["stored_bytes"] for r in cells),
            }
        value = (ppl or {}).get("pipelines", {}).get(name, {}).get("ppl")
        reference = full_ppl(ppl, name)
        row["ppl"] = value
        row["ppl_change"] = None if value is None or not reference else value / reference - 1
        table.append(row)
    return table


def markdown(table: list[dict], lengths: list[int], ppl_tokens: int | None = None, prefill: int = 0,
             intervals: bool = False) -> str:
    ppl = f"ppl {ppl_tokens:,} tok" if ppl_tokens else "ppl"
    if ppl_tokens and prefill:
        ppl = f"ppl of {ppl_tokens - prefill:,} tok after a {prefill:,}-tok prefill"
    what = "of full [95% interval]" if intervals else "of full"
    head = "| pipeline | " + " | ".join(f"{n:,} tok: found / {what} / bytes x" for n in lengths) + f" | {ppl} (change) |"
    lines = [head, "|---" * (len(lengths) + 2) + "|"]
    for row in table:
        cells = []
        for n in lengths:
            c = row["lengths"][n]
            share = c["of_full"] / c["full_found"] if c["full_found"] else float("nan")
            bounds = ""
            if intervals:
                low, high = wilson(c["of_full"], c["full_found"])
                bounds = f" [{low:.0%}-{high:.0%}]"
            cells.append(f"{c['hits']}/{c['cases']} / {c['of_full']}/{c['full_found']} ({share:.1%}){bounds} / {c['ratio']:.2f}x")
        ppl = "-" if row["ppl"] is None else f"{row['ppl']:.2f} ({row['ppl_change']:+.1%})"
        lines.append(f"| `{row['pipeline']}` | " + " | ".join(cells) + f" | {ppl} |")
    return "\n".join(lines)


def misses(table: list[dict], lengths: list[int]) -> str:
    """Per pipeline, the cells the full cache answers and it does not."""
    lines = []
    for row in table:
        if row["pipeline"] == "full":
            continue
        cells = [cell for n in lengths for cell in row["lengths"][n]["missed"]]
        lines.append(f"- `{row['pipeline']}`: " + (", ".join(f"({n}, {d:g}, {k})" for n, d, k in cells) or "none"))
    return "\n".join(lines)


def plot(table: list[dict], lengths: list[int], path: Path, title: str, ppl: dict | None = None) -> list[str]:
    """One panel per context length (needles found, of full, against real bytes) and, where ``ppl`` holds any of
    the pipelines, one more: the perplexity change against the perplexity run's real bytes. Returns the panels'
    titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    measured = (ppl or {}).get("pipelines", {})
    with_ppl = [row for row in table if row["pipeline"] in measured and full_ppl(ppl, row["pipeline"])]
    unmeasured = [row["pipeline"] for row in with_ppl if not {"ppl", "stored_bytes"} <= set(measured[row["pipeline"]])]
    if unmeasured:  # e.g. {"error": "not run"}: a perplexity run stopped before them
        print(f"frontier_plot: perplexity panel without {', '.join(unmeasured)}: their ppl.json entry holds no perplexity "
              f"and bytes ({measured[unmeasured[0]].get('error', 'no reason given')})", file=sys.stderr)
        with_ppl = [row for row in with_ppl if row["pipeline"] not in unmeasured]
    panels = len(lengths) + (1 if with_ppl else 0)
    columns = 1 + len(table) // 25
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels + 2.5 * columns, 4.5 + 0.06 * max(0, len(table) - 25)),
                             squeeze=False)
    axes = list(axes[0])
    markers = "osD^v<>pP*Xh"
    colors = plt.get_cmap("tab20").colors
    style = {row["pipeline"]: (markers[i % len(markers)], colors[i % len(colors)]) for i, row in enumerate(table)}
    ratios = [c["ratio"] for row in table for c in row["lengths"].values()]
    ppl_ratio = {row["pipeline"]: measured[row["pipeline"]]["full_16bit_bytes"] / measured[row["pipeline"]]["stored_bytes"]
                 for row in with_ppl}
    ratios += list(ppl_ratio.values())
    ticks = [t for t in (1, 2, 3, 4, 5, 6, 8, 10, 16, 32, 64) if t <= 1.3 * max(ratios + [10])]

    def bytes_axis(ax) -> None:
        ax.axvline(5.0, color="grey", lw=0.8, ls=":")
        ax.axvline(8.0, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.set_xticks(ticks)
        ax.set_xticklabels([str(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel("real stored bytes: x less than a 16-bit cache")

    for ax, n in zip(axes, lengths):
        for row in table:  # one colour and marker per pipeline, named in the legend
            c = row["lengths"][n]
            share = c["of_full"] / c["full_found"] if c["full_found"] else 0.0
            marker, color = style[row["pipeline"]]
            ax.scatter(c["ratio"], share, s=45, marker=marker, color=color, label=row["pipeline"], alpha=0.85)
        ax.axhline(0.95, color="grey", lw=0.8, ls="--")
        ax.axhline(0.75, color="grey", lw=0.8, ls=":")
        bytes_axis(ax)
        ax.set_title(f"{n:,} tokens")
        ax.set_ylabel("needles found, of what the full cache finds" if ax is axes[0] else "")
    needle_axes = axes[:len(lengths)]
    low = min(ax.get_ylim()[0] for ax in needle_axes)
    high = max(ax.get_ylim()[1] for ax in needle_axes)
    for ax in needle_axes:  # one scale for every length
        ax.set_ylim(low, high)
    if with_ppl:
        ax = axes[-1]
        for row in with_ppl:
            marker, color = style[row["pipeline"]]
            ax.scatter(ppl_ratio[row["pipeline"]], 100 * (measured[row["pipeline"]]["ppl"] / full_ppl(ppl, row["pipeline"]) - 1), s=45,
                       marker=marker, color=color, alpha=0.85)
        ax.axhline(2.0, color="grey", lw=0.8, ls="--")
        ax.axhline(0.0, color="grey", lw=0.5)
        ax.set_yscale("symlog", linthresh=5.0)  # linear to +-5%, logarithmic past it (some pipelines lose 10x)
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:+g}%"))
        bytes_axis(ax)
        prefill = (ppl or {}).get("prefill", 0)
        ax.set_title(f"perplexity of {ppl.get('tokens', 0) - prefill:,} tokens" + (f" after {prefill:,}" if prefill else ""))
        ax.set_ylabel("perplexity change against the full cache")
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper left", bbox_to_anchor=(1.0, 0.92), fontsize=8, frameon=False, ncol=columns)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return [ax.get_title() for ax in axes]


def merged(folders: list[Path]) -> tuple[dict, dict | None]:
    """needle.json and ppl.json of ``folders`` as one: each pipeline from the first folder that has it."""
    needle: dict | None = None
    ppl: dict | None = None
    for folder in folders:
        needle_file = folder / "needle.json"
        if not needle_file.is_file():  # a perplexity run of its own: its ppl.json joins the others below
            if not (folder / "ppl.json").is_file():
                raise SystemExit(f"frontier_plot: {folder} holds neither needle.json nor ppl.json (kvweave eval needle / ppl results)")
        elif needle is None:
            needle = json.loads(needle_file.read_text())
        else:
            part = json.loads(needle_file.read_text())
            grid = ("lengths", "depths", "needles", "protocol")
            if any(part.get(key) != needle.get(key) for key in grid):
                raise SystemExit(f"{folder}/needle.json: its grid ({', '.join(f'{k}={part.get(k)}' for k in grid)}) differs from the first folder's")
            for name, data in part["pipelines"].items():
                needle["pipelines"].setdefault(name, data)
        ppl_file = folder / "ppl.json"
        if ppl_file.is_file():
            more = json.loads(ppl_file.read_text())
            if ppl is None:
                ppl = more
            else:
                protocol = ("tokens", "chunk", "prefill")
                if any(more.get(key, 0 if key == "prefill" else None) != ppl.get(key, 0 if key == "prefill" else None) for key in protocol):
                    print(f"frontier_plot: {folder}/ppl.json left out: measured with {', '.join(f'{k}={more.get(k)}' for k in protocol)}, "
                          f"the first ppl.json with {', '.join(f'{k}={ppl.get(k)}' for k in protocol)}; perplexities of "
                          "different runs do not compare", file=sys.stderr)
                    continue
                own = more.get("dynamic_cache_ppl")
                if own != ppl.get("dynamic_cache_ppl"):  # another device or dtype: same protocol, its own full cache
                    print(f"frontier_plot: {folder}/ppl.json measured the full cache at {own} (the first ppl.json: "
                          f"{ppl.get('dynamic_cache_ppl')}): its pipelines' changes are taken against its own full cache",
                          file=sys.stderr)
                for name, data in more.get("pipelines", {}).items():
                    if name not in ppl["pipelines"]:
                        ppl["pipelines"][name] = data if own == ppl.get("dynamic_cache_ppl") else {**data, "reference": own}
    return needle, ppl  # type: ignore[return-value]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+")
    parser.add_argument("--out", type=Path, default=None, help="plot file (default FIRST_FOLDER/frontier.png)")
    parser.add_argument("--intervals", action="store_true", help="95%% Wilson interval of each 'of full' share")
    parser.add_argument("--misses", action="store_true", help="the cells each pipeline misses of those the full cache finds")
    parser.add_argument("--common", action="store_true", help="count only the cells every pipeline ran")
    args = parser.parse_args()
    needle, ppl = merged(args.folders)
    if needle is None:
        raise SystemExit("frontier_plot: none of the folders holds a needle.json")
    table = rows(needle, ppl, args.common)
    print(markdown(table, needle["lengths"], (ppl or {}).get("tokens"), (ppl or {}).get("prefill", 0), args.intervals))
    if args.misses:
        print("\nmissed of what the full cache finds (length, depth, needle):\n" + misses(table, needle["lengths"]))
    title = f"needles ({needle.get('protocol', 'query-aware')}) vs real bytes"
    plot(table, needle["lengths"], args.out or args.folders[0] / "frontier.png", title, ppl)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
