#!/bin/bash
# Run 4: Nsight Compute over one call of the dense kernel per shape, at the GPU's own clock (--clock-control none):
# its issue slots busy, stall reasons and DRAM throughput. OUT=folder bash docs/perf/gpu-2026-12-07-floor/ncu.sh
OUT=${OUT:-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
D=docs/perf/gpu-2026-12-07-floor
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader > "$OUT/gpu-ncu.txt"
# SHAPES="storage tokens batch,..." another list (the shapes comma-separated)
IFS=, read -ra shapes <<< "${SHAPES:-k4v2e48t 131072 32,k4v2e48t 131072 1,k4v4e77t 131072 32}"
for shape in "${shapes[@]}"; do
  set -- $shape
  name=ncu-$1-$2-$3
  ncu --kernel-name regex:_lowbit_dense_kernel --launch-skip 2 --launch-count 1 --set full --clock-control none \
    --import-source yes -o "$OUT/$name" python $D/dense_calls.py $1 $2 $3 >/dev/null 2>&1
  ncu -i "$OUT/$name.ncu-rep" --page details > "$OUT/$name-details.txt"
  ncu -i "$OUT/$name.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv"
  python docs/perf/h200-2026-12-03-planes/ncu_summary.py "$OUT/src.csv" > "$OUT/$name-summary.txt"
  rm -f "$OUT/src.csv" "$OUT/$name.ncu-rep"
done
