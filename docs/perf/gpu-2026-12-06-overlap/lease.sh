#!/bin/bash
# A prompt's flushes a basis group behind the forward, on a side CUDA stream (kvweave.engine.overlap).
# PART=a: the GPU tests of the overlap (and of the waits inside a flush); then the first token at 32K of depthweave-kv
#         and of the ~4x class (l-qa35v3) with the overlap off (KVWEAVE_FLUSH_OVERLAP=0), on, and on with the side
#         stream's priority up (KVWEAVE_FLUSH_PRIORITY=1), in turn.
# PART=b: the same first tokens a second time, then the CUDA graphs' GPU tests (decode steps after an overlapped prompt).
# PART=c: the block's float32 copies cut (the sketch's rows scaled in their copy, the residuals added in place, the
#         probe reading the encoder's copy, the token factors decoded layer by layer): the first token at 32K with the
#         tree before (BEFORE=folder, the overlap's first tree, its priority up) and this one, in turn, twice, the GPU
#         tests between the rounds.
# Run from the repository's root: OUT=folder PART=a|b|c [BEFORE=folder] [ROUNDS=1|2] bash docs/perf/gpu-2026-12-06-overlap/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
ttft_round() {
  for setting in "0 0" "1 0" "1 1"; do
    set -- $setting
    echo "KVWEAVE_FLUSH_OVERLAP=$1 KVWEAVE_FLUSH_PRIORITY=$2 round $ROUND" >> "$OUT/ab-ttft.txt"
    step 150 ab-ttft.txt env KVWEAVE_FLUSH_OVERLAP=$1 KVWEAVE_FLUSH_PRIORITY=$2 python benchmarks/decode_e2e.py \
      --registry benchmarks/lean_sweep.toml --methods full,depthweave-kv,l-qa35v3 --ttft 32768 --batches "" \
      --out /tmp/kvweave-ttft-$1$2
  done
}
if [ "${PART:-a}" = a ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_flush_overlap.py tests/test_host_to_device.py
  ROUND=1 ttft_round
elif [ "$PART" = b ]; then
  ROUND=2 ttft_round
  step 300 gpu-graphs.txt python -m pytest -q -p no:cacheprovider tests/test_graphs_gpu.py
elif [ "$PART" = c ]; then  # the tree before (BEFORE=folder holding it, imported as kvweave) and this one, in turn
  mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
  for round in $(seq 1 "${ROUNDS:-2}"); do
    echo "before, round $round" >> "$OUT/ab-ttft.txt"
    step 150 ab-ttft.txt env KVWEAVE_FLUSH_PRIORITY=1 PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python \
      $BEFORE/benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-before-ttft
    echo "this tree, round $round" >> "$OUT/ab-ttft.txt"
    step 150 ab-ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" \
      --out /tmp/kvweave-ttft
    [ "$round" = 1 ] && step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_flush_overlap.py \
      tests/test_host_to_device.py
  done
fi
