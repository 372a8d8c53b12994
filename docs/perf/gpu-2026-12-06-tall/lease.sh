#!/bin/bash
# depthweave-kv's prompt products summed over the block's tokens in chunks (kvweave.core.linalg.tall_product).
# PART=a: the GPU tests of the chunked products and of the stages that use them, then tall_products.py (the three
#         stages at each chunk length, against one product), then the first token at 32K with the chunks off
#         (KVWEAVE_TALL_CHUNK=0) and on, in turn, twice; then the first token profiled by stage with the chunks on.
# PART=b: the subspace iterations by fewer Cholesky rounds: their GPU tests (and the dense kernel's early loads'), then
#         tall_products.py, then the first token at 32K with the tree before (BEFORE=folder) and this one, in turn,
#         twice; then this tree's first token profiled by stage, and where its flushes wait for the GPU (8 layers).
# Run from the repository's root: OUT=folder PART=a|b [BEFORE=folder] bash docs/perf/gpu-2026-12-06-tall/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
if [ "${PART:-a}" = a ]; then
  step 150 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_linalg.py tests/test_residual_fit.py
  step 120 tall-products.txt python benchmarks/tall_products.py --tokens 32640,32768 --chunks 0,512,1024,2048,4096
  for round in 1 2; do
    for chunk in 0 1024; do
      echo "KVWEAVE_TALL_CHUNK=$chunk round $round" >> "$OUT/ab-ttft.txt"
      step 120 ab-ttft.txt env KVWEAVE_TALL_CHUNK=$chunk python benchmarks/decode_e2e.py --methods full,depthweave-kv \
        --ttft 32768 --batches "" --out /tmp/kvweave-ttft-$chunk
    done
  done
  step 150 prefill-dw.txt python benchmarks/profile_prefill.py --tokens 32768 --ops 30
elif [ "$PART" = b ]; then  # the tree before (BEFORE=folder holding it, imported as kvweave) and this one, in turn
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tall_product.py tests/test_linalg.py tests/test_host_to_device.py \
    tests/test_residual_fit.py tests/test_dense_ahead.py
  step 120 tall-products.txt python benchmarks/tall_products.py --tokens 32640 --chunks 0,1024
  mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
  for round in 1 2; do
    echo "before, round $round" >> "$OUT/ab-ttft.txt"
    step 120 ab-ttft.txt env PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python $BEFORE/benchmarks/decode_e2e.py \
      --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-before-ttft
    echo "this tree, round $round" >> "$OUT/ab-ttft.txt"
    step 120 ab-ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" \
      --out /tmp/kvweave-ttft
  done
  step 150 prefill-dw.txt python benchmarks/profile_prefill.py --tokens 32768 --ops 30
  step 120 syncs.txt python docs/perf/h200-2026-12-04-ttft/prefill_syncs.py --pipeline depthweave-kv --layers 8
fi
