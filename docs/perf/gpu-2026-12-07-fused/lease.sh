#!/bin/bash
# The combine done by the dense kernel's own programs (KVWEAVE_FUSED_COMBINE): its GPU tests and the dense kernel's,
# then benchmarks/lowbit_kernel.py --cold-l2 at 32K-128K for the 8x and ~5x classes' layers and the two kinds of
# layer of kzd-k4vq25-f40 (weighed by benchmarks/layer_mix.py): setting 1 (the default: fused past one wave) at
# B = 1, 8, 32; setting 0 (two launches) at B = 8 and 32, where 1 differs from it; setting 2 (fused at one wave too,
# instead of the early combine) at B = 1, where it differs from 1.
# Runs at 1b530a5, where the setting exists (removed after this run: slower everywhere).
# OUT=/tmp/o timeout 590 bash docs/perf/gpu-2026-12-07-fused/lease.sh; tar czf $OUT/all.tgz -C /tmp/o .
source benchmarks/lease_preamble.sh
step 200 tests.md python -m pytest -q -p no:cacheprovider tests/test_fused_combine.py tests/test_lowbit_gpu.py \
  -k "gpu or real_sizes or sm90"
bench() {  # storage, setting, batches
  KVWEAVE_FUSED_COMBINE=$2 step 100 $1-f$2.md python benchmarks/lowbit_kernel.py --reps 10 \
    --tokens 32768,65536,131072 --batches $3 --storage $1 --post-rope --configs dense:64:4:0 --cold-l2 \
    --out "$OUT/$1-f$2"
}
for storage in k4v2e48t k4v4e77t; do bench $storage 1 1,8,32; bench $storage 0 8,32; bench $storage 2 1; done
bench k4v2e40t 1 1,8,32; bench k4v4e40t 1 1,8,32
step 30 mix-f1.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-f1/lowbit_kernel.json:22" "$OUT/k4v4e40t-f1/lowbit_kernel.json:8"
bench k4v2e40t 0 8,32; bench k4v4e40t 0 8,32
step 30 mix-f0.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-f0/lowbit_kernel.json:22" "$OUT/k4v4e40t-f0/lowbit_kernel.json:8"
bench k4v2e40t 2 1; bench k4v4e40t 2 1
step 30 mix-f2.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-f2/lowbit_kernel.json:22" "$OUT/k4v4e40t-f2/lowbit_kernel.json:8"
