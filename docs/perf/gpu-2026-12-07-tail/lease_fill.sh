#!/bin/bash
# The dense kernel's one wave filled (KVWEAVE_DENSE_FILL=1: as many splits as the slots hold, a group apart) against
# the splits of before (0), each in turn, one row, every call past the L2 cache: the 8x class's storage twice, the ~5x
# class's and kzd-k4vq25-f40's two storages once; first the GPU tests of the shorter and the filled splits.
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-tail/lease_fill.sh
# (run once, run4-fill/; the switch was removed after it: no gain, docs/kernels.md "One wave filled to the slots")
source benchmarks/lease_preamble.sh
step 120 tests.md python -m pytest -q -p no:cacheprovider tests/test_dense_tail.py -k gpu
run() {  # run NAME FILL STORAGE
  step 100 $1.md env KVWEAVE_DENSE_FILL=$2 python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 \
    --batches 1 --storage $3 --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/$1"
}
for round in 1 2; do for fill in 0 1; do run 8x-fill$fill-r$round $fill k4v2e48t; done; done
for s in k4v4e77t k4v2e40t k4v4e40t; do for fill in 0 1; do run $s-fill$fill $fill $s; done; done
