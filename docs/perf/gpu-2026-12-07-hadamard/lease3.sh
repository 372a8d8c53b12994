#!/bin/bash
# The transform where the combine merges the splits in tiles (head_dim 256): its GPU test, then
# benchmarks/lowbit_kernel.py --shape d256 --cold-l2 at B = 8 and 32, 128K, both classes' layers, with
# KVWEAVE_COMBINE_HADAMARD=1 (the transform; run3/ ran with the setting of then, 2, the transform past one tile of
# splits, which 1 is now) and =0 in turn.
# OUT=... timeout 330 bash docs/perf/gpu-2026-12-07-hadamard/lease3.sh   (writes only the tables under $OUT)
source benchmarks/lease_preamble.sh
step 150 tests.md python -m pytest -q -p no:cacheprovider tests/test_combine_hadamard.py -k gpu
for storage in k4v2e48t k4v4e77t; do
  for h in 1 0; do
    KVWEAVE_COMBINE_HADAMARD=$h step 60 d256-$storage-h$h.md python benchmarks/lowbit_kernel.py --reps 10 \
      --tokens 131072 --batches 8,32 --shape d256 --storage $storage --post-rope --configs dense:64:4:0 --cold-l2 \
      --out /tmp/lk-$storage-h$h
  done
done
