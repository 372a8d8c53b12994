#!/bin/bash
# The 8x class's decode kernel at small batches, and the tiled 8x pipeline's first token.
# PART=a: the packing kernels' and the dense kernel's GPU tests; the kernel time split into the packed pass and the
# combine (k4v2e48t, k4v4e77t; 32K and 128K; B = 1 and 8; the launch's programs and two other counts at B = 1); the
# first token at 32K of the full cache and the 8x storage scored by a surrogate, values token by token and in tiles.
# PART=k: the kernel grid only (CONFIGS=..., STORAGES=..., TOKENS=..., BATCHES=...).
# PART=p: the combine launched early: its GPU tests and the lowbit and graph GPU tests, then the grid with it and
# without it (KVWEAVE_PROGRAMMATIC_COMBINE=0) in turn.
# PART=q: the same with the combine launched early only where the packed pass is one wave: its GPU test, the grid.
# PART=d: depthweave-kv's tiles pass launched as the exact pass's dependent: the early launches' tests and the graph
# tests on the GPU, then decode_kernel.py with it (-together) and without it (-in-turn, KVWEAVE_PROGRAMMATIC_EXACT=0).
# Run from the repository's root: OUT=folder PART=a|k|p|q|d bash docs/perf/gpu-2026-12-05-night/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i warn >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
grid() {
  for storage in ${STORAGES:-k4v2e48t k4v4e77t}; do
    step 200 "kernel-$storage${TAG}.txt" python benchmarks/lowbit_kernel.py --post-rope --reps 10 --storage "$storage" \
      --configs "${CONFIGS:-dense:64:4}" --tokens "${TOKENS:-32768,131072}" --batches "${BATCHES:-1,8}" --out "$OUT/json-$storage${TAG}"
  done
}
if [ "${PART:-a}" = a ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_pack_kernels.py tests/test_lowbit_dense.py tests/test_lowbit_fixed.py
  CONFIGS=dense:64:4,dense:64:4:256,dense:64:4:1024 grid
  REG=/tmp/kvweave-surrogate-registry
  python benchmarks/surrogate_registry.py --out $REG --pipelines kzd-k4v2-f48-d128,kzd-k4v2t-f48-d128 > /dev/null
  step 200 ttft.txt python benchmarks/decode_e2e.py --registry $REG/registry.toml --methods full,kzd-k4v2-f48-d128-s,kzd-k4v2t-f48-d128-s --ttft 32768 --batches "" --out /tmp/kvweave-ttft
  cat /tmp/kvweave-ttft/decode_e2e.md >> "$OUT/ttft.txt" 2>/dev/null
elif [ "$PART" = d ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_programmatic_launch.py tests/test_graphs_gpu.py
  for way in together in-turn; do
    flag=1; [ $way = in-turn ] && flag=0
    KVWEAVE_PROGRAMMATIC_EXACT=$flag step 200 "fused-$way.txt" python benchmarks/decode_kernel.py --tokens ${TOKENS:-32768,131072} --batches ${BATCHES:-1,8} --reps 20 --out "$OUT/json-fused-$way"
  done
elif [ "$PART" = q ]; then
  step 120 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_programmatic_launch.py
  BATCHES=${BATCHES:-1,8} TAG=-wave grid
elif [ "$PART" = p ]; then
  step 120 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_programmatic_launch.py tests/test_graphs_gpu.py
  KVWEAVE_GPU_VARIANTS=dense,auto step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_lowbit_gpu.py
  BATCHES=${BATCHES:-1,8,32} TAG=-early grid
  KVWEAVE_PROGRAMMATIC_COMBINE=0 BATCHES=${BATCHES:-1,8,32} TAG=-after grid
else
  grid
fi
