#!/bin/bash
# The dense kernel with each step's codes asked of the L2 cache 2, 4 or 8 steps ahead (the tricks l2ahead2/4/8)
# against the launch as it is, every call past the L2 cache (--cold-l2): both storages at B = 1 (one wave, where a
# program's steps wait on DRAM in turn), then B = 8 and 32. The GPU test first (the outputs unchanged, bit for bit).
# OUT=folder bash docs/perf/gpu-2026-12-07-l2ahead/lease.sh   (NO_WIDE=1: B = 1 alone)
source benchmarks/lease_preamble.sh
step 240 tests.md python -m pytest -q -p no:cacheprovider tests/test_dense_l2ahead.py -k gpu
CONFIGS=dense:64:4:0,dense:64:4:0:l2ahead2,dense:64:4:0:l2ahead4,dense:64:4:0:l2ahead8
for storage in k4v2e48t k4v4e77t; do
  step 200 $storage-b1.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1 \
    --storage $storage --post-rope --configs $CONFIGS --cold-l2 --out "$OUT/$storage-b1"
done
if [ -z "$NO_WIDE" ]; then
  for storage in k4v2e48t k4v4e77t; do
    step 240 $storage-b8.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,131072 --batches 8,32 \
      --storage $storage --post-rope --configs dense:64:4:0,dense:64:4:0:l2ahead2,dense:64:4:0:l2ahead4 --cold-l2 \
      --out "$OUT/$storage-b8"
  done
fi
