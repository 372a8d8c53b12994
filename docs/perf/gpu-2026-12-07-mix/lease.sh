#!/bin/bash
# The 8x class's best storage by needles, kzd-k4vq25-f40 (benchmarks/dense_sweep.toml: 40% of the tokens kept, 22 of
# 30 layers with 2-bit values, 8 with 4-bit uniform ones), against the kernel bars: each kind of layer timed by
# benchmarks/lowbit_kernel.py --cold-l2 at B = 1, 8, 32 and 32K-128K, then weighed by benchmarks/layer_mix.py; the
# 48%-kept 2-bit storage of "Where the kernel bars stand" again in the same lease (the machine's baseline), and the
# dense kernel's GPU tests first (its loop a plain range again).
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-mix/lease.sh; tar czf $OUT/all.tgz -C /tmp/o .
source benchmarks/lease_preamble.sh
step 240 tests.md python -m pytest -q -p no:cacheprovider tests/test_lowbit_gpu.py tests/test_dense_ahead.py \
  tests/test_dense_fold.py tests/test_lowbit_dense.py -k "gpu or real_sizes or sm90"
for storage in k4v2e40t k4v4e40t k4v2e48t; do
  step 150 $storage.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1,8,32 \
    --storage $storage --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/$storage"
done
step 30 mix.md python benchmarks/layer_mix.py "$OUT/k4v2e40t/lowbit_kernel.json:22" "$OUT/k4v4e40t/lowbit_kernel.json:8"
