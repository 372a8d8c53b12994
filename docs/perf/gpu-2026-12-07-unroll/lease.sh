#!/bin/bash
# The dense kernel at one batch row with its token loop unrolled by two (KVWEAVE_DENSE_UNROLL=2) at 168 registers a
# thread (KVWEAVE_DENSE_WAVE_REGISTERS=168: 3 programs an SM), against 168 registers alone and the launch as it is,
# every call past the L2 cache: both storages, 32K-128K, the launch's programs and 392 (one wave at 168 registers at
# every length; the launch's own is 496 from 64K up). The GPU tests first (the outputs the same).
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-unroll/lease.sh; tar czf $OUT/all.tgz -C /tmp/o .   (more
# files than a call brings back; the tar within the call's 600 s). NCU=1 adds Nsight Compute over one call at one row,
# 32K, each storage (the launch as it is, then unrolled);
# FOLD=1 times the 8x class's storage with its keys' statistics over 128 tokens (k4g128v2e48t, 10.0x, bar 7.0x) at
# B = 8 and 32, its fold every step and once a group (KVWEAVE_DENSE_FOLD=0 / 1).
source benchmarks/lease_preamble.sh
step 300 tests.md python -m pytest -q -p no:cacheprovider tests/test_dense_unroll.py -k gpu
for storage in k4v2e48t k4v4e77t; do
  for setting in "1 128" "1 168" "2 168"; do
    set -- $setting
    KVWEAVE_DENSE_UNROLL=$1 KVWEAVE_DENSE_WAVE_REGISTERS=$2 step 150 $storage-u$1-r$2.md python \
      benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536,131072 --batches 1 --storage $storage --post-rope \
      --configs dense:64:4:0,dense:64:4:392 --cold-l2
  done
done
if [ -n "$NCU" ]; then
  SHAPES="k4v2e48t 32768 1,k4v4e77t 32768 1" OUT="$OUT/ncu" bash docs/perf/gpu-2026-12-07-floor/ncu.sh
  KVWEAVE_DENSE_UNROLL=2 KVWEAVE_DENSE_WAVE_REGISTERS=168 SHAPES="k4v2e48t 32768 1,k4v4e77t 32768 1" \
    OUT="$OUT/ncu-unrolled" bash docs/perf/gpu-2026-12-07-floor/ncu.sh
fi
if [ -n "$FOLD" ]; then
  for fold in 0 1; do
    KVWEAVE_DENSE_FOLD=$fold step 150 k4g128v2e48t-fold$fold.md python benchmarks/lowbit_kernel.py --reps 10 \
      --tokens 32768,65536 --batches 8,32 --storage k4g128v2e48t --post-rope --configs dense:64:4:0 --cold-l2
  done
fi
