#!/bin/bash
# The dense kernel's last wave of splits made shorter (kvweave.kernels.lowbit_tail.DENSE_TAIL, KVWEAVE_DENSE_TAIL in
# percent of the other splits' length) against every split alike, each in turn, every call past the L2 cache: the 8x
# class's storage at B = 8 and 32, 32K and 64K; the GPU test of the shorter splits; a timeline at 50%.
# OUT=/tmp/o timeout 540 bash docs/perf/gpu-2026-12-07-timeline/lease_tail.sh
# (TAILS="0 50 33": the settings in turn; TOKENS=32768: one length; NO_TIMELINE=1: no timeline)
source benchmarks/lease_preamble.sh
step 100 tests.md python -m pytest -q -p no:cacheprovider tests/test_dense_tail.py -k gpu
for tail in ${TAILS:-0 50 33 0}; do
  step 100 tail$tail.md env KVWEAVE_DENSE_TAIL=$tail python benchmarks/lowbit_kernel.py --reps 10 --tokens ${TOKENS:-32768,65536} \
    --batches 8,32 --storage k4v2e48t --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/tail$tail"
done
[ -z "$NO_TIMELINE" ] && step 90 timeline50.md env KVWEAVE_DENSE_TAIL=50 python benchmarks/dense_timeline.py --storage k4v2e48t --tokens 32768 \
  --batches 8,32 --calls 5 --cold-l2 --out "$OUT/timeline50"
