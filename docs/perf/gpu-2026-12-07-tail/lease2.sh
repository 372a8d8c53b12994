#!/bin/bash
# The dense kernel with its last wave of splits at 33% (the default since the runs of lease.sh): the GPU tests of the
# launches it changes, the cells of the bars table not timed by lease.sh (kzd-k4vq25-f40's two storages at every
# length and batch, the ~5x class at one row), and the timeline at 32K with the shorter last wave and without.
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-tail/lease2.sh
source benchmarks/lease_preamble.sh
step 200 tests.md python -m pytest -q -p no:cacheprovider tests/test_dense_tail.py tests/test_programmatic_launch.py \
  tests/test_timeline.py tests/test_graphs_gpu.py tests/test_dense_ahead.py -k "gpu or cuda or graph"
run() {  # run NAME STORAGE TOKENS BATCHES
  step 120 $1.md python benchmarks/lowbit_kernel.py --reps 10 --tokens $3 --batches $4 --storage $2 --post-rope \
    --configs dense:64:4:0 --cold-l2 --out "$OUT/$1"
}
for s in k4v2e40t k4v4e40t; do run $s $s 32768,65536,131072 1,8,32; done
run 5x-b1 k4v4e77t 32768,65536,131072 1
for tail in 33 0; do
  step 90 timeline$tail.md env KVWEAVE_DENSE_TAIL=$tail python benchmarks/dense_timeline.py --storage k4v2e48t \
    --tokens 32768 --batches 8,32 --calls 5 --cold-l2 --out "$OUT/timeline$tail"
done
