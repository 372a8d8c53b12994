#!/bin/bash
# The combine undoing the values' Hadamard rotation by a fast Walsh-Hadamard transform (KVWEAVE_COMBINE_HADAMARD=1,
# the default) against reading the 128 x 128 float32 matrix in every program (=0): its GPU test, then
# benchmarks/lowbit_kernel.py --cold-l2 at B = 1, 8, 32 and 32K-128K, each setting in turn, for the 8x and ~5x
# classes' layers, then the 8x class's best pipeline by needles (kzd-k4vq25-f40's two kinds of layer, weighed by
# benchmarks/layer_mix.py) with the transform, and without it if the time is left.
# OUT=/tmp/o timeout 540 bash docs/perf/gpu-2026-12-07-hadamard/lease.sh; tar czf $OUT/all.tgz -C /tmp/o .
source benchmarks/lease_preamble.sh
step 150 tests.md python -m pytest -q -p no:cacheprovider tests/test_combine_hadamard.py -k gpu
bench() {  # storage, setting
  KVWEAVE_COMBINE_HADAMARD=$2 step 100 $1-h$2.md python benchmarks/lowbit_kernel.py --reps 10 \
    --tokens 32768,65536,131072 --batches 1,8,32 --storage $1 --post-rope --configs dense:64:4:0 --cold-l2 \
    --out "$OUT/$1-h$2"
}
for storage in k4v2e48t k4v4e77t; do bench $storage 1; bench $storage 0; done
bench k4v2e40t 1; bench k4v4e40t 1
step 30 mix-h1.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-h1/lowbit_kernel.json:22" "$OUT/k4v4e40t-h1/lowbit_kernel.json:8"
bench k4v2e40t 0; bench k4v4e40t 0
step 30 mix-h0.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-h0/lowbit_kernel.json:22" "$OUT/k4v4e40t-h0/lowbit_kernel.json:8"
