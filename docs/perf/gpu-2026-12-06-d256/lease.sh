#!/bin/bash
# head_dim 256 on the GPU (16 query heads on 8 KV heads: Gemma-2-9B's and Gemma-3-12B's attention): the GPU tests
# (packing kernels, the dense kernel against its twin, a Gemma-3 model of head_dim 256 against the reference path),
# then lowbit_kernel.py --shape d256 over the 8x and ~5x classes' storages against SDPA: the launch's build, the same
# capped at 128 registers (r128), and for the flat 8x storage the wide kernel (the default at head_dim 256 before).
# Run from the repository's root: OUT=folder bash docs/perf/gpu-2026-12-06-d256/lease.sh
source benchmarks/lease_preamble.sh
step 150 run2-tests.txt python -m pytest -q -p no:cacheprovider tests/test_wide_heads_gpu.py tests/test_pack_kernels.py \
  tests/test_lowbit_gpu.py -k "wide_heads or pack or window_append"
step 130 run2-k4v2e48.md python benchmarks/lowbit_kernel.py --shape d256 --post-rope --storage k4v2e48 --reps 10 \
  --tokens 32768,131072 --batches 1,8,32 --configs dense:64:4:0,wide:32:4:0 --out "$OUT/k4v2e48"
step 130 run2-k4v2e48t.md python benchmarks/lowbit_kernel.py --shape d256 --post-rope --storage k4v2e48t --reps 10 \
  --tokens 32768,65536,131072 --batches 1,8,32 --configs dense:64:4:0,dense:64:4:0:r128 --out "$OUT/k4v2e48t"
step 130 run2-k4v4e77t.md python benchmarks/lowbit_kernel.py --shape d256 --post-rope --storage k4v4e77t --reps 10 \
  --tokens 32768,65536,131072 --batches 1,8,32 --configs dense:64:4:0,dense:64:4:0:r128 --out "$OUT/k4v4e77t"
