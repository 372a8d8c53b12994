#!/bin/bash
# Codes asked of the L2 cache steps ahead, every call past the L2 cache (--cold-l2): the dense kernel with the tricks
# l2ahead2/4/8 against the launch as it is, both storages at B = 1 (one wave, where a program's steps wait on DRAM in
# turn); depthweave-kv's tiles pass with KVWEAVE_TILES_L2AHEAD=0 and 4; then the dense kernel at B = 8 and 32. The GPU
# tests first (the outputs unchanged).
# OUT=folder bash docs/perf/gpu-2026-12-07-l2ahead/lease.sh   (NO_WIDE=1: no B = 8 and 32; NO_DW=1: no depthweave-kv)
source benchmarks/lease_preamble.sh
step 200 tests.md python -m pytest -q -p no:cacheprovider tests/test_l2ahead.py tests/test_tiles_bytes.py -k "gpu and (l2 or L2AHEAD)"
CONFIGS=dense:64:4:0,dense:64:4:0:l2ahead2,dense:64:4:0:l2ahead4,dense:64:4:0:l2ahead8
for storage in k4v2e48t k4v4e77t; do
  step 150 $storage-b1.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1 \
    --storage $storage --post-rope --configs $CONFIGS --cold-l2 --out "$OUT/$storage-b1"
done
if [ -z "$NO_DW" ]; then
  for steps in 0 4; do
    KVWEAVE_TILES_L2AHEAD=$steps step 120 depthweave-l2ahead$steps.md python benchmarks/decode_kernel.py \
      --tokens 32768,131072 --batches 1,8 --reps 20 --cold-l2 --out "$OUT/depthweave-l2ahead$steps"
  done
fi
if [ -z "$NO_WIDE" ]; then
  for storage in k4v2e48t k4v4e77t; do
    step 150 $storage-b8.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,131072 --batches 8,32 \
      --storage $storage --post-rope --configs dense:64:4:0,dense:64:4:0:l2ahead2,dense:64:4:0:l2ahead4 --cold-l2 \
      --out "$OUT/$storage-b8"
  done
fi
