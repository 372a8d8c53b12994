#!/bin/bash
# The kernels as Triton 3.9 (what a fresh install takes) builds them, on the GPU machine, whose own Triton is
# 3.6: the same cells with each, in one lease. Triton 3.9 travels in parts (benchmarks/carry_triton.py):
#   here:  python benchmarks/carry_triton.py pack            (wheels/triton-3.9.0-1 and -2, about 29 MB each)
#   run 1: carry [wheels/triton-3.9.0-1], command `true` (or a lease of its own, e.g. the splits lease with NO_B1=1):
#          what a call carried stays there while the machine is warm
#   run 2, within 30 s: carry [wheels/triton-3.9.0-2], command
#          OUT=$OUT timeout 580 bash docs/perf/gpu-2026-12-07-triton39/lease.sh
#   run 3, while warm: PART=tests OUT=$OUT timeout 590 bash ... (Triton 3.9's GPU tests of the kernels, a step a file, TEST_LIMIT
#          seconds each, default 200; FILES: which, e.g. FILES="test_timeline test_kernels" for a second call)
# Each step's table in $OUT/NAME.md; 3.6 first (the machine's), then 3.9: the dense kernel
# at the launch's register caps (Triton 3.9's sm_90 build spills there) and at 168 (no spill, 3 programs an SM), and
# depthweave-kv's tiles pass (179 registers with 3.9, 168 with 3.6: 11 programs an SM instead of 12).
source benchmarks/lease_preamble.sh
if [ "$PART" = tests ]; then
  step 30 unpack.md python benchmarks/carry_triton.py unpack
  source results/triton-3.9.0/env.sh
  # a step a file, each under its own limit, so that what ran is kept when a later one is cut (run under an outer
  # timeout of at least the sum: 30 + 4 x TEST_LIMIT)
  for file in ${FILES:-test_lowbit_gpu test_dense_ahead test_timeline test_kernels}; do
    step ${TEST_LIMIT:-200} t39-$file.md python -m pytest -q -p no:cacheprovider -rs tests/$file.py
  done
  exit
fi
cells="--reps 10 --tokens ${TOKENS:-32768} --batches ${BATCHES:-1,8} --post-rope --configs dense:64:4:0 --cold-l2"
for storage in k4v2e48t k4v4e77t; do
  step 100 t36-$storage.md python benchmarks/lowbit_kernel.py --storage $storage $cells --out "$OUT/t36-$storage"
done
step 100 t36-dw.md python benchmarks/decode_kernel.py --tokens 32768 --batches 1,8 --reps 20 --cold-l2 --out "$OUT/t36-dw"
step 60 unpack.md python benchmarks/carry_triton.py unpack
source results/triton-3.9.0/env.sh
python -c "import triton; print('then triton', triton.__version__, triton.__file__)" >> "$OUT/gpu.txt"
for storage in k4v2e48t k4v4e77t; do
  step 100 t39-$storage.md python benchmarks/lowbit_kernel.py --storage $storage $cells --out "$OUT/t39-$storage"
  KVWEAVE_DENSE_REGISTERS=168 step 100 t39-r168-$storage.md python benchmarks/lowbit_kernel.py --storage $storage $cells \
    --out "$OUT/t39-r168-$storage"
done
step 100 t39-dw.md python benchmarks/decode_kernel.py --tokens 32768 --batches 1,8 --reps 20 --cold-l2 --out "$OUT/t39-dw"
