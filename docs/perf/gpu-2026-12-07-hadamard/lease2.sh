#!/bin/bash
# The transform in the combine by KV head too (past 256 rows: B > 32 at 8 KV heads): its GPU test (B = 1, 8, 32, 40),
# then benchmarks/lowbit_kernel.py --cold-l2 at B = 64 and 128, 32K and 64K, with KVWEAVE_COMBINE_HADAMARD=1 and =0 in
# turn, both classes' layers.
# OUT=/tmp/o timeout 540 bash docs/perf/gpu-2026-12-07-hadamard/lease2.sh; tar czf $OUT/all.tgz -C /tmp/o .
source benchmarks/lease_preamble.sh
step 150 tests.md python -m pytest -q -p no:cacheprovider tests/test_combine_hadamard.py -k gpu
for storage in k4v2e48t k4v4e77t; do
  for h in 1 0; do
    KVWEAVE_COMBINE_HADAMARD=$h step 120 $storage-h$h.md python benchmarks/lowbit_kernel.py --reps 10 \
      --tokens 32768,65536 --batches 64,128 --storage $storage --post-rope --configs dense:64:4:0 --cold-l2 \
      --out "$OUT/$storage-h$h"
  done
done
