#!/bin/bash
# The dense kernel's codes loaded a step ahead and its 128-register build, against the launch's build, in one run.
# PART=a: the GPU tests of the early loads and of the early combine; then lowbit_kernel.py over the 8x and ~5x classes'
# storages (values in tiles), T = 32K and 128K, B = 1 and 8, four configurations: the launch's, r128, r128+kahead,
# r128+kahead+vahead.
# PART=c: the combine in slices of a query head's channels and with more warps (KVWEAVE_COMBINE_SLICES /
# KVWEAVE_COMBINE_WARPS), each setting a run of the grid over the 8x class (the first with the values' words ahead at 96
# and 128 registers too), then the ~5x class at two settings; their GPU tests first.
# PART=r: the rule on (the values' words ahead at 128 registers where the programs are one wave at 128): its GPU
# tests, then the grid over both classes with the rule on and off (KVWEAVE_DENSE_AHEAD=0), in turn, twice (B = 1 only
# the second time; ROUNDS=1 once; GRAPH_TESTS= without the graph tests); then the ~5x class with `r128+vahead`.
# PART=k: the grid only (CONFIGS=..., STORAGES=..., TOKENS=..., BATCHES=..., TAG=...).
# Run from the repository's root: OUT=folder PART=a|c|r|k bash docs/perf/gpu-2026-12-05-ahead/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i warn >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
AHEAD=dense:64:4,dense:64:4:0:r128,dense:64:4:0:r128+kahead,dense:64:4:0:r128+kahead+vahead
grid() {
  for storage in ${STORAGES:-k4v2e48t k4v4e77t}; do
    step 240 "kernel-$storage${TAG}.txt" python benchmarks/lowbit_kernel.py --post-rope --reps 10 --storage "$storage" \
      --configs "${CONFIGS:-$AHEAD}" --tokens "${TOKENS:-32768,131072}" --batches "${BATCHES:-1,8}" --out "$OUT/json-$storage${TAG}"
  done
}
if [ "${PART:-a}" = a ]; then
  step 150 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_dense_ahead.py tests/test_programmatic_launch.py
  grid
elif [ "$PART" = c ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_combine_slices.py tests/test_programmatic_launch.py
  for setting in ${SETTINGS:-1/4 4/4 8/4 4/8 2/4}; do
    slices=${setting%/*} warps=${setting#*/} configs=dense:64:4
    [ "$setting" = 1/4 ] && configs=dense:64:4,dense:64:4:0:vahead,dense:64:4:0:r128+vahead
    KVWEAVE_COMBINE_SLICES=$slices KVWEAVE_COMBINE_WARPS=$warps STORAGES=k4v2e48t CONFIGS=$configs TAG=-s$slices-w$warps grid
  done
  for setting in 1/4 4/4; do
    KVWEAVE_COMBINE_SLICES=${setting%/*} KVWEAVE_COMBINE_WARPS=${setting#*/} CONFIGS=dense:64:4 STORAGES=k4v4e77t TAG=-s${setting%/*}-w${setting#*/} grid
  done
elif [ "$PART" = r ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_dense_ahead.py ${GRAPH_TESTS-tests/test_graphs_gpu.py}
  for round in ${ROUNDS:-1 2}; do
    batches=1,8; [ $round = 2 ] && batches=1
    KVWEAVE_DENSE_AHEAD=1 BATCHES=$batches CONFIGS=dense:64:4 TAG=-on$round grid
    KVWEAVE_DENSE_AHEAD=0 BATCHES=$batches CONFIGS=dense:64:4 TAG=-off$round grid
  done
  # the ~5x class's 4-bit values (not in the rule's DENSE_AHEAD_BITS) with the values' words ahead at 128 registers
  STORAGES=k4v4e77t CONFIGS=dense:64:4,dense:64:4:0:r128+vahead TAG=-v4 grid
else
  grid
fi
