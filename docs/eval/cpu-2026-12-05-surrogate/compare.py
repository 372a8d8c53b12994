"""The figures of docs/frontier.md "Scores without the repetition", from this folder's cells (and, for KVzip's cells
that ran on the H200 only, from docs/eval/h200-2026-12-02-8x):

    python docs/eval/cpu-2026-12-05-surrogate/compare.py

Per grid: cases the full cache finds, each pipeline's finds of those with the 95% Wilson interval, the stored-bytes
ratio against a 16-bit cache (summed over the cases), seconds a case, the finds by depth, and the cases two pipelines
answer differently. A pipeline's cells may come from another folder run with the same needles; its cells are matched
to the full cache's by (depth, needle) after checking that each asks the same number.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
from frontier_plot import wilson  # noqa: E402

H200 = ROOT / "docs" / "eval" / "h200-2026-12-02-8x" / "smollm" / "kz-qa3-vl25-f48-cp"
SURROGATE = "kvzip-surrogate-qa3-vl25-smollm2"
GRIDS = [  # (title, folder of the full cache, length, [(label, folder, pipeline)])
    ("SmolLM2-135M, 2,000 tokens, 30 cases", "smollm-needle", 2000,
     [("KVzip", "smollm-needle", "kvzip-qa3-vl25-smollm2"), ("surrogate", "smollm-needle", SURROGATE)]),
    ("SmolLM2-135M, 2,000 tokens, 90 cases", "smollm-needle-x30", 2000,
     [("KVzip (H200 cells)", H200, "kz-qa3-vl25-f48-cp"), ("surrogate", "smollm-needle-x30", SURROGATE)]),
    ("SmolLM2-135M, 5,000 tokens, 30 cases", "smollm-needle-5000", 5000,
     [("KVzip (H200 cells)", H200, "kz-qa3-vl25-f48-cp"), ("surrogate", "smollm-needle-5000", SURROGATE)]),
    ("Gemma-3-270m, 2,000 tokens, 30 cases", "gemma-needle", 2000,
     [("KVzip", "gemma-needle", "g-kz-qa35v3-f50-st192"), ("surrogate", "gemma-needle", "g-kzs-qa35v3-f50-st192"),
      ("surrogate, context read once", "gemma-needle-once", "g-kzs-qa35v3-f50-st192")]),
]


def cells(folder: str | Path, pipeline: str, length: int) -> dict[tuple[float, int], dict]:
    path = Path(folder) if Path(folder).is_absolute() else HERE / folder
    rows = (json.loads(line) for line in (path / "cells.jsonl").read_text().splitlines() if line.strip())
    return {(c["depth"], c["needle"]): c for c in rows if c["pipeline"] == pipeline and c["length"] == length}


def main() -> None:
    for title, full_folder, length, pipelines in GRIDS:
        full = cells(full_folder, "full", length)
        found = [key for key, c in full.items() if c["hit"]]
        print(f"\n## {title}: the full cache finds {len(found)} of {len(full)}")
        print("| pipeline | of full [95%] | bytes x | seconds a case | by depth (of the full cache's finds) |")
        print("|---|---|---:|---:|---|")
        runs = {}
        for label, folder, pipeline in pipelines:
            run = cells(folder, pipeline, length)
            if set(run) < set(full) or any(run[k]["expected"] != full[k]["expected"] for k in full):
                raise SystemExit(f"{label}: its cells are not the full cache's needles")
            runs[label] = run
            hits = sum(run[k]["hit"] for k in found)
            low, high = wilson(hits, len(found))
            ratio = sum(run[k]["full_16bit_bytes"] for k in full) / sum(run[k]["stored_bytes"] for k in full)
            seconds = sum(run[k]["seconds"] for k in full) / len(full)
            depths = sorted({k[0] for k in full})
            by_depth = ", ".join(f"{d}: {sum(run[k]['hit'] for k in found if k[0] == d)}/{sum(1 for k in found if k[0] == d)}" for d in depths)
            print(f"| {label} | {hits}/{len(found)} ({100 * hits / max(1, len(found)):.1f}%) [{100 * low:.0f}-{100 * high:.0f}%] "
                  f"| {ratio:.2f}x | {seconds:.1f} | {by_depth} |")
        labels = list(runs)
        for a, b in zip(labels, labels[1:]):  # each pipeline against the one before it
            first, second = runs[a], runs[b]
            differ = [k for k in full if first[k]["hit"] != second[k]["hit"]]
            print(f"answered differently: {len(differ)} cases, {sum(first[k]['hit'] for k in differ)} found by {a} alone, "
                  f"{sum(second[k]['hit'] for k in differ)} by {b} alone")
    cpu, h200 = cells("smollm-needle", "kvzip-qa3-vl25-smollm2", 2000), cells(H200, "kz-qa3-vl25-f48-cp", 2000)
    print(f"\nKVzip on this CPU and on the H200, the same 2,000-token cases: the same answer on "
          f"{sum(cpu[k]['hit'] == h200[k]['hit'] for k in cpu)} of {len(cpu)}; found {sum(c['hit'] for c in cpu.values())} "
          f"and {sum(h200[k]['hit'] for k in cpu)}")


if __name__ == "__main__":
    main()
