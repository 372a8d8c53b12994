#!/bin/bash
# Value layers at 4 bits in the 8x class's fast storage, and the pre-RoPE dense build's GPU check: the GPU tests of
# the dense kernel's pre-RoPE reading, then model.generate (Llama-3-8B shape, CUDA graphs) over the 8x class's storage
# with 2-bit values everywhere, with 4-bit values in a quarter of the layers, and with its keys before RoPE (the dense
# kernel taking them: KVWEAVE_DENSE_ROPE=1), then the pre-RoPE kernel alone at 16 rotary pairs a part.
# Run from the repository's root: OUT=folder bash docs/perf/gpu-2026-12-06-vq/lease.sh (run 2: RUN2=1)
source benchmarks/lease_preamble.sh
if [ -z "$RUN2" ]; then  # run 1
  if [ -z "$NO_TESTS" ]; then
    step 100 tests.txt python -m pytest -q -p no:cacheprovider tests/test_dense_rope.py tests/test_value_tiles.py
    KVWEAVE_GPU_VARIANTS=dense step 160 tests.txt python -m pytest -q -p no:cacheprovider tests/test_lowbit_gpu.py \
      -k "twin_on_the_gpu"
  fi
  KVWEAVE_DENSE_ROPE=1 step 260 e2e.txt python benchmarks/decode_e2e.py --registry benchmarks/dense_sweep.toml \
    --methods kzd-k4v2t-f48-d128@graphs,kzd-k4vq25t-f48-d128@graphs,kzp-k4v2t-f48-d128@graphs --batches 1,8 \
    --context 16384 --steps 40 --out "$OUT/e2e"
  KVWEAVE_ROPE_PAIRS=16 step 90 k4v2e48t-p16.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,131072 \
    --batches 1,8,32 --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p16"
fi
# run 2: the pre-RoPE build at 32 and 64 pairs a part (16 timed in run 1), and model.generate at 64K (the context)
if [ -n "$RUN2" ]; then
  for pairs in ${PAIRS:-32 64}; do
    KVWEAVE_ROPE_PAIRS=$pairs step 90 k4v2e48t-p$pairs.md python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,131072 \
      --batches 1,8,32 --storage k4v2e48t --configs dense:64:4:0 --out "$OUT/k4v2e48t-p$pairs"
  done
  if [ -z "$NO_E2E" ]; then
    step 300 e2e64k.txt python benchmarks/decode_e2e.py --registry benchmarks/dense_sweep.toml \
      --methods full,kzd-k4v2t-f48-d128@graphs,kzd-k4vq25t-f48-d128@graphs --batches 1,8 --context 65536 --steps 40 \
      --out "$OUT/e2e64k"
  fi
fi
