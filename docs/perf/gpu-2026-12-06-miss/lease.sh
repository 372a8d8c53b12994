#!/bin/bash
# depthweave-kv's misses by one Triton kernel (kvweave/kernels/miss.py) and its residual coordinates selected rank-major.
# PART=a: the GPU tests of the changed stages; the two steps alone (miss_ops.py); the first token at 32K with the tree
#         before (BEFORE=folder), this tree, and this tree with the kernel off (KVWEAVE_FUSED_MISS=0), in turn, ROUNDS
#         times, each run with depthweave-kv-tf32 (benchmarks/products_sweep.toml: its block's float32 products on TF32).
# PART=b: the prompt's stages by device time on this tree (the overlap off, so that each stage's time is its own).
# PART=c: the flush's remaining copies and the residual moment's products, each way (flush_copies.py).
# PART=d: the GPU tests of the overlap; where the first token waits (timeline.py) with the last flush at the forward's
#         end and at its group's request (KVWEAVE_FLUSH_AT_END=0); the first token at 32K with the tree before
#         (BEFORE=folder), this tree, and this tree with KVWEAVE_FLUSH_AT_END=0, in turn, ROUNDS times. Run on commit
#         ee7a609, whose setting was measured and not kept (README.md): on a later tree the setting does nothing.
# Run from the repository's root: OUT=folder PART=a BEFORE=folder [ROUNDS=2] bash docs/perf/gpu-2026-12-06-miss/lease.sh
#                                 OUT=folder PART=b bash docs/perf/gpu-2026-12-06-miss/lease.sh
#                                 OUT=folder PART=c bash docs/perf/gpu-2026-12-06-miss/lease.sh
#                                 OUT=folder PART=d BEFORE=folder [ROUNDS=2] bash docs/perf/gpu-2026-12-06-miss/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
METHODS="--registry benchmarks/products_sweep.toml --methods full,depthweave-kv,depthweave-kv-tf32 --ttft 32768 --batches"
# the first token at 32K with the tree in folder $1 (imported as kvweave from a link to it)
tree_ttft() {
  local link=/tmp/kvweave-tree-$(basename "$1")
  mkdir -p "$link" && ln -sfn "$(cd "$1" && pwd)" "$link/kvweave"
  echo "$1, round $round" >> "$OUT/ab-ttft.txt"
  step 150 ab-ttft.txt env PYTHONPATH=$link:$1/benchmarks python $1/benchmarks/decode_e2e.py $METHODS "" --out /tmp/kvweave-ttft-$(basename "$1")
}
this_ttft() {
  echo "this tree${1:+, $1}, round $round" >> "$OUT/ab-ttft.txt"
  step 150 ab-ttft.txt env $1 python benchmarks/decode_e2e.py $METHODS "" --out /tmp/kvweave-ttft
}
if [ "${PART:-a}" = a ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_block_miss.py tests/test_host_to_device.py \
    tests/test_flush_overlap.py tests/test_products_precision.py
  step 100 miss-ops.txt python docs/perf/gpu-2026-12-06-miss/miss_ops.py
  for round in $(seq 1 "${ROUNDS:-2}"); do tree_ttft "$BEFORE"; this_ttft; this_ttft KVWEAVE_FUSED_MISS=0; done
elif [ "$PART" = b ]; then
  step 150 prefill-ops.txt env KVWEAVE_FLUSH_OVERLAP=0 python benchmarks/profile_prefill.py --tokens 32768 --ops 60
fi
if [ "$PART" = c ]; then
  step 100 flush-copies.txt env PYTHONPATH=docs/perf/gpu-2026-12-06-miss python docs/perf/gpu-2026-12-06-miss/flush_copies.py
fi
if [ "$PART" = d ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_flush_overlap.py tests/test_host_to_device.py
  step 100 timeline.txt python docs/perf/gpu-2026-12-06-miss/timeline.py
  step 100 timeline.txt env KVWEAVE_FLUSH_AT_END=0 python docs/perf/gpu-2026-12-06-miss/timeline.py
  METHODS="--methods full,depthweave-kv --ttft 32768 --batches"
  for round in $(seq 1 "${ROUNDS:-2}"); do tree_ttft "$BEFORE"; this_ttft; this_ttft KVWEAVE_FLUSH_AT_END=0; done
fi
