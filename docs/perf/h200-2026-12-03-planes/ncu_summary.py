"""Where a kernel's warps waited, from Nsight Compute's per-instruction source page:

    ncu --kernel-name regex:_lowbit_dense --launch-skip 2 --launch-count 1 --set full --import-source yes -o dense \\
        python docs/perf/h200-2026-12-03-planes/switches.py 8 --post-rope --storage k4v2e48 --tokens 65536 \\
        --batches 128 --reps 2 --configs dense:64:4
    ncu -i dense.ncu-rep --page source --csv --print-source sass > source.csv
    python docs/perf/h200-2026-12-03-planes/ncu_summary.py source.csv

prints the share of the stall samples by reason, the shared-memory wavefronts, and the instructions the warps waited
at most (with their two largest reasons)."""

import csv
import sys


def main(path: str, top: int = 12) -> None:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    at = {name: index for index, name in enumerate(header)}

    def value(row, name):
        try:
            return float(row[at[name]].replace(",", ""))
        except (KeyError, ValueError):
            return 0.0

    samples = "Warp Stall Sampling (All Samples)"
    total = sum(value(row, samples) for row in data)
    reasons = [name for name in header if name.startswith("stall_") and "Not Issued" not in name]
    shares = sorted(((sum(value(row, name) for row in data) / total, name[6:]) for name in reasons), reverse=True)
    print("| stall reason | share of samples |\n|---|---:|")
    for share, name in shares:
        if share >= 0.005:
            print(f"| {name} | {100 * share:.1f}% |")
    print(f"\nshared-memory wavefronts: {sum(value(row, 'L1 Wavefronts Shared') for row in data):,.0f}\n")
    print("| instruction | share of samples | largest reasons |\n|---|---:|---|")
    for row in sorted(data, key=lambda row: -value(row, samples))[:top]:
        why = sorted(((value(row, name), name[6:]) for name in reasons), reverse=True)[:2]
        print(f"| `{row[1].strip()}` | {100 * value(row, samples) / total:.1f}% | "
              + ", ".join(f"{name} {100 * count / total:.1f}%" for count, name in why) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
