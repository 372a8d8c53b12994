#!/bin/bash
# One lease for three things, in the order they matter, each step capped:
# 1. the dense kernel's GPU tests under Triton 3.9 (what torch 2.13 installs; its sm_90 build makes warpgroup products
#    from registers, ASM = 1, a build no GPU had run), the machine's own Triton being 3.6;
# 2. where the dense kernel's call goes among its programs (benchmarks/dense_timeline.py, Triton 3.6, past the L2);
# 3. benchmarks/lowbit_kernel.py over the 8x class's storage under Triton 3.6 and 3.9 in turn (past the L2).
# The Triton 3.9 wheel's parts (its CUDA backend and ptxas only, tar.xz split in two under 64 MiB, in the ignored
# wheels/ folder) travel in two calls: call 1 carries wheels/t39a and runs `PART=copy bash ...lease2.sh`; call 2
# carries wheels/t39b and runs `OUT=... timeout 580 bash ...lease2.sh`.
if [ "$PART" = copy ]; then mkdir -p /tmp/m && cp wheels/t39a/* /tmp/m/ && ls -la /tmp/m; exit; fi
source benchmarks/lease_preamble.sh
cat /tmp/m/tr39.part.aa wheels/t39b/tr39.part.ab > /tmp/t39.tar.xz && sha256sum /tmp/t39.tar.xz >> "$OUT/gpu.txt"
mkdir -p /tmp/t39 && tar xJf /tmp/t39.tar.xz -C /tmp/t39
PYTHONPATH=/tmp/t39 python -c "import torch, triton; print('carried: torch', torch.__version__, 'triton', triton.__version__)" >> "$OUT/gpu.txt" 2>&1
step 160 tests39.md env PYTHONPATH=/tmp/t39 KVWEAVE_GPU_VARIANTS=dense python -m pytest -v -p no:cacheprovider \
  tests/test_lowbit_gpu.py::test_values_in_tiles_give_the_token_major_output_at_real_sizes tests/test_timeline.py \
  tests/test_lowbit_gpu.py::test_each_compiled_kernel_matches_its_twin_on_the_gpu -k "tiles or gpu"
step 150 timeline.md python benchmarks/dense_timeline.py --storage k4v2e48t --tokens 32768,65536 --batches 1,8,32 \
  --calls 5 --cold-l2 --out "$OUT/timeline"
for tr in 36 39; do
  path=""; [ $tr = 39 ] && path=/tmp/t39
  step 90 k4v2e48t-t$tr.md env PYTHONPATH=$path python benchmarks/lowbit_kernel.py --reps 10 --tokens 32768,65536 \
    --batches 1,8 --storage k4v2e48t --post-rope --configs dense:64:4:0 --cold-l2 --out "$OUT/k4v2e48t-t$tr"
done
