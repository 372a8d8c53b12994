#!/bin/bash
# The floor under the kernel bars: reading each storage's bytes and nothing else (one launch, and a pass + a dependent
# fold, split-K's shape) against SDPA and the dense kernel in the same run; then the ~5x class at B = 1 with other
# splits and warps (its two cells nearest the bar), and the pre-RoPE build at 32 rotary pairs a part.
# Run from the repository's root: OUT=folder [FLOOR_ARGS=--warm-l2] [NO_SWEEP=1] [NO_P32=1] bash docs/perf/gpu-2026-12-07-floor/lease.sh
source benchmarks/lease_preamble.sh
step 330 floor.md python benchmarks/read_floor.py --out "$OUT/floor" $FLOOR_ARGS
if [ -z "$NO_SWEEP" ]; then
  step 150 k4v4e77t-b1.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536 --batches 1 \
    --storage k4v4e77t --post-rope --configs dense:64:4:0,dense:64:4:256,dense:64:4:384,dense:64:2:0,dense:64:2:1024 \
    --out "$OUT/k4v4e77t-b1"
fi
if [ -z "$NO_P32" ]; then
  KVWEAVE_ROPE_PAIRS=32 step 100 k4v2e48t-p32.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,131072 \
    --batches 1,8,32 --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p32"
fi
