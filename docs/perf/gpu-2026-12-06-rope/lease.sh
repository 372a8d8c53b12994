#!/bin/bash
# Keys stored before RoPE read by the dense kernel (ROPE: dequantized and rotated in registers): the GPU tests, then
# lowbit_kernel.py over the pre-RoPE storages against SDPA (the dense kernel; for prerope-k4v2's storage the wide
# kernel too, the default before) and the 8x class's post-RoPE storage as the baseline of the same run.
# Run from the repository's root: OUT=folder bash docs/perf/gpu-2026-12-06-rope/lease.sh
source benchmarks/lease_preamble.sh
BENCH="python benchmarks/lowbit_kernel.py --reps 10 --tokens ${TOKENS:-32768,131072} --batches ${BATCHES:-1,8,32}"
if [ "${PART:-1}" = 1 ]; then  # run 1: the first build (halves of the rotary pairs, outliers put in place per element)
  if [ -z "$NO_TESTS" ]; then
    step 100 tests.txt python -m pytest -q -p no:cacheprovider tests/test_dense_rope.py
    KVWEAVE_GPU_VARIANTS=dense,auto step 160 tests.txt python -m pytest -q -x -p no:cacheprovider tests/test_lowbit_gpu.py \
      -k "twin_on_the_gpu"
  fi
  step 100 k4v2e48t.md $BENCH --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t"
  step 100 k4v2e48t-post.md $BENCH --storage k4v2e48t --post-rope --configs dense:64:4:0 --out "$OUT/k4v2e48t-post"
  step 100 k4v4e77t.md $BENCH --storage k4v4e77t --configs dense:64:4:0 --out "$OUT/k4v4e77t"
  step 100 k4v2.md $BENCH --storage k4v2 --configs dense:64:4:0,wide:32:4:0 --out "$OUT/k4v2"
else  # run 2: 16 or 32 rotary pairs at a time, outliers as a correction per slot, head_dim 64 refused; model.generate
  if [ -z "$NO_TESTS" ]; then
    step 100 tests.txt python -m pytest -q -p no:cacheprovider tests/test_dense_rope.py
    KVWEAVE_GPU_VARIANTS=dense step 160 tests.txt python -m pytest -q -p no:cacheprovider tests/test_lowbit_gpu.py \
      -k "twin_on_the_gpu"
  fi
  KVWEAVE_ROPE_PAIRS=16 step 100 k4v2e48t-p16.md $BENCH --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p16"
  KVWEAVE_DENSE_ROPE=1 step 170 e2e.txt python benchmarks/decode_e2e.py --registry benchmarks/dense_sweep.toml \
    --methods kzd-k4v2t-f48-d128@graphs,kzp-k4v2t-f48-d128@graphs --batches 1,8 --context 16384 --steps 40 --out "$OUT/e2e"
  KVWEAVE_ROPE_PAIRS=16 step 100 k4v4e77t-p16.md $BENCH --storage k4v4e77t --configs dense:64:4:0 --out "$OUT/k4v4e77t-p16"
  KVWEAVE_ROPE_PAIRS=32 step 100 k4v2e48t-p32.md $BENCH --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p32"
fi
