#!/bin/bash
# The floor under the kernel bars: reading each storage's bytes and nothing else (one launch, and a pass + a dependent
# fold, split-K's shape) against SDPA and the dense kernel in the same run; then both storages at B = 1 with other
# programs and warps (the cells nearest their bars; NO_SWEEP=1 skips it, NO_MAIN=1 runs only it), and the pre-RoPE
# build at 16 and at 32 rotary pairs a part (NO_P32=1 skips it).
# Run 1 (made): OUT=folder NO_SWEEP=1 NO_P32=1 FLOOR_ARGS=--warm-l2 bash docs/perf/gpu-2026-12-07-floor/lease.sh (the
# script had no other mode then). Run 2: OUT=folder bash docs/perf/gpu-2026-12-07-floor/lease.sh, with COLD=1 first: the
# floor and the kernels with every call reading its own copy, the copies past the L2 cache (--cold-l2).
source benchmarks/lease_preamble.sh
if [ -n "$NO_MAIN" ]; then
  :
elif [ -n "$COLD" ]; then
  step 330 floor-cold.md python benchmarks/read_floor.py --out "$OUT/floor-cold"
  for storage in k4v2e48t k4v4e77t; do
    step 150 $storage-cold.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1,8 \
      --storage $storage --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/$storage-cold"
  done
  step 200 depthweave-cold.md python benchmarks/decode_kernel.py --tokens 32768,131072 --batches 1,8 --reps 20 --cold-l2 \
    --out "$OUT/depthweave-cold"
else
  step 330 floor.md python benchmarks/read_floor.py --out "$OUT/floor" $FLOOR_ARGS
fi
if [ -z "$NO_SWEEP" ]; then  # B = 1: other programs (splits) and warps, each storage (SWEEP="k4v4e77t" for one)
  for storage in ${SWEEP:-k4v4e77t k4v2e48t}; do
    step 200 $storage-b1.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1 \
      --storage $storage --post-rope \
      --configs dense:64:4:0,dense:64:4:256,dense:64:4:384,dense:64:4:1024,dense:64:2:0,dense:64:2:1024 \
      ${COLD:+--cold-l2} --out "$OUT/$storage-b1"
  done
fi
if [ -z "$NO_P32" ]; then  # keys before RoPE, 16 then 32 rotary pairs a part (run 3: after one 32-pair call)
  for pairs in 16 32; do
    KVWEAVE_ROPE_PAIRS=$pairs step 100 k4v2e48t-p$pairs.md python benchmarks/lowbit_kernel.py --reps 10 \
      --tokens 32768,131072 --batches 1,8,32 --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p$pairs"
  done
fi
