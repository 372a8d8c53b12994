#!/bin/bash
# The dense kernel's shorter last wave (KVWEAVE_DENSE_TAIL, percent of the other splits' length) in turn with every
# split alike, every call past the L2 cache: the 8x class's storage (k4v2e48t) at 25/33/67%, the ~5x class's
# (k4v4e77t) and the two storages of kzd-k4vq25-f40 (k4v2e40t, k4v4e40t) at 33%.
# OUT=/tmp/o timeout 540 bash docs/perf/gpu-2026-12-07-tail/lease.sh
source benchmarks/lease_preamble.sh
run() {  # run NAME TAIL STORAGE TOKENS BATCHES
  step 120 $1.md env KVWEAVE_DENSE_TAIL=$2 python benchmarks/lowbit_kernel.py --reps 10 --tokens $4 --batches $5 \
    --storage $3 --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/$1"
}
for tail in ${TAILS:-25 67 33 0}; do run 8x-tail$tail $tail k4v2e48t 32768,65536,131072 1,8,32; done
for tail in 33 0; do
  run 5x-tail$tail $tail k4v4e77t 32768,65536,131072 8,32
  for s in k4v2e40t k4v4e40t; do run $s-tail$tail $tail $s 32768,65536 8; done
done
