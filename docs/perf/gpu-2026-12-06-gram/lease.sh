#!/bin/bash
# depthweave-kv's sketch from the rows' Gram matrix (a 16-bit block multiplied as it is), its coefficients without a
# copy of the block, the residuals on a basis projected from the float32 misses and added by baddbmm.
# PART=a: the GPU tests of the changed stages (the Gram matrix of 16-bit blocks, the bases, the waits inside a flush,
#         the overlap); the first token at 32K with the tree before (BEFORE=folder) and this one, in turn, ROUNDS times;
#         then the prompt's stages by device time on this tree (the overlap off, so that each stage's time is its own).
# Run from the repository's root: OUT=folder PART=a BEFORE=folder [ROUNDS=2] bash docs/perf/gpu-2026-12-06-gram/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
if [ "${PART:-a}" = a ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_bases.py \
    tests/test_host_to_device.py tests/test_flush_overlap.py
  mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
  for round in $(seq 1 "${ROUNDS:-2}"); do
    echo "before, round $round" >> "$OUT/ab-ttft.txt"
    step 150 ab-ttft.txt env PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python \
      $BEFORE/benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-before-ttft
    echo "this tree, round $round" >> "$OUT/ab-ttft.txt"
    step 150 ab-ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" \
      --out /tmp/kvweave-ttft
  done
  step 150 prefill-ops.txt env KVWEAVE_FLUSH_OVERLAP=0 python benchmarks/profile_prefill.py --tokens 32768 --ops 60
fi
