#!/bin/bash
# The dense kernel under Triton 3.9 (what torch 2.13 installs; its sm_90 build makes warpgroup products from registers,
# ASM = 1) on a GPU machine whose own Triton is 3.6: the GPU tests of the lowbit kernels under 3.9, then
# benchmarks/lowbit_kernel.py over the 8x class's storage under 3.6 and 3.9 in turn, every call past the L2 cache.
# The Triton 3.9 wheel's parts (only its CUDA backend and ptxas; tar.xz, split in two under 64 MiB, in the ignored
# wheels/ folder) travel in two calls: call 1 carries wheels/t39a and runs `PART=copy bash ...triton39.sh`, call 2
# carries wheels/t39b and runs `OUT=... timeout 560 bash ...triton39.sh`.
if [ "$PART" = copy ]; then mkdir -p /tmp/m && cp wheels/t39a/* /tmp/m/ && ls -la /tmp/m; exit; fi
source benchmarks/lease_preamble.sh
if [ ! -d /tmp/t39/triton ]; then
  cat /tmp/m/tr39.part.aa wheels/t39b/tr39.part.ab > /tmp/t39.tar.xz && sha256sum /tmp/t39.tar.xz >> "$OUT/gpu.txt"
  mkdir -p /tmp/t39 && tar xJf /tmp/t39.tar.xz -C /tmp/t39
fi
PYTHONPATH=/tmp/t39 python -c "import torch, triton; print('with the carried Triton: torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt"
export KVWEAVE_GPU_VARIANTS=dense
step 200 tests39.md env PYTHONPATH=/tmp/t39 python -m pytest -q -p no:cacheprovider tests/test_lowbit_gpu.py
step 100 tests39.md env PYTHONPATH=/tmp/t39 python -m pytest -q -p no:cacheprovider tests/test_timeline.py \
  tests/test_combine_hadamard.py tests/test_programmatic_launch.py -k gpu
for tr in 36 39; do
  path=""; [ $tr = 39 ] && path=/tmp/t39
  step 150 k4v2e48t-t$tr.md env PYTHONPATH=$path python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536 \
    --batches 1,8,32 --storage k4v2e48t --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/k4v2e48t-t$tr"
done
