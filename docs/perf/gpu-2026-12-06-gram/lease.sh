#!/bin/bash
# depthweave-kv's sketch from the rows' Gram matrix (a 16-bit block multiplied as it is), its coefficients without a
# copy of the block, the residuals on a basis projected from the float32 misses and added by baddbmm; then the probe's
# float32 copies of the other kind (the values' measurement without the keys, the keys' copy of the values kept as the
# values' own).
# PART=a: the GPU tests of the changed stages (the Gram matrix of 16-bit blocks, the bases, the waits inside a flush,
#         the overlap); the first token at 32K with the tree before (BEFORE=folder) and this one, in turn, ROUNDS times;
#         then the prompt's stages by device time on this tree (the overlap off, so that each stage's time is its own).
# PART=b: the first token at 32K with each tree of TREES (folders, in turn) and this one, ROUNDS times; the residual
#         stages' kernels (residual_ops.py); the GPU tests; the prompt's stages by device time.
# Run from the repository's root: OUT=folder PART=a BEFORE=folder [ROUNDS=2] bash docs/perf/gpu-2026-12-06-gram/lease.sh
#                                 OUT=folder PART=b TREES="folder folder" [ROUNDS=2] bash docs/perf/gpu-2026-12-06-gram/lease.sh
#                                 OUT=folder PART=c BEFORE=folder [ROUNDS=2] bash docs/perf/gpu-2026-12-06-gram/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
# the first token at 32K with the tree in folder $1 (imported as kvweave from a link to it)
tree_ttft() {
  local link=/tmp/kvweave-tree-$(basename "$1")
  mkdir -p "$link" && ln -sfn "$(cd "$1" && pwd)" "$link/kvweave"
  echo "$1, round $round" >> "$OUT/ab-ttft.txt"
  step 150 ab-ttft.txt env PYTHONPATH=$link:$1/benchmarks python $1/benchmarks/decode_e2e.py --methods full,depthweave-kv \
    --ttft 32768 --batches "" --out /tmp/kvweave-ttft-$(basename "$1")
}
this_ttft() {
  echo "this tree, round $round" >> "$OUT/ab-ttft.txt"
  step 150 ab-ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-ttft
}
if [ "${PART:-a}" = a ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_bases.py \
    tests/test_host_to_device.py tests/test_flush_overlap.py
  for round in $(seq 1 "${ROUNDS:-2}"); do tree_ttft "$BEFORE"; this_ttft; done
  step 150 prefill-ops.txt env KVWEAVE_FLUSH_OVERLAP=0 python benchmarks/profile_prefill.py --tokens 32768 --ops 60
elif [ "$PART" = b ]; then
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for tree in $TREES; do tree_ttft "$tree"; done
    this_ttft
  done
  step 100 residual-ops.txt python docs/perf/gpu-2026-12-06-gram/residual_ops.py
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_host_to_device.py \
    tests/test_flush_overlap.py
  step 150 prefill-ops.txt env KVWEAVE_FLUSH_OVERLAP=0 python benchmarks/profile_prefill.py --tokens 32768 --ops 60
fi
# PART=c: the GPU tests; how near each sketch path's bases come to the exact subspace (sketch_angle.py); the first
#         token at 32K with the tree before (BEFORE=folder) and this one, in turn, ROUNDS times.
if [ "$PART" = c ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_bases.py \
    tests/test_host_to_device.py tests/test_flush_overlap.py
  step 150 sketch-angle.txt python docs/perf/gpu-2026-12-06-gram/sketch_angle.py
  for round in $(seq 1 "${ROUNDS:-2}"); do tree_ttft "$BEFORE"; this_ttft; done
fi
