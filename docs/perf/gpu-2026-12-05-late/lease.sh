#!/bin/bash
# depthweave-kv's one-pass combine against the two-pass one, and its first token with the probe's shared products.
# PART=c: the combine's tests and the fused kernel's on the GPU, then decode_kernel.py with both combines in one run,
#         the one-pass one with 4 and 8 programs a query head (32K and 128K, B = 1 and 8; TOKENS=..., BATCHES=...,
#         COMBINES=... to change).
# PART=g: with the one-pass combine the default, its tests, the fused kernel's and the graph tests on the GPU.
# PART=b: depthweave-kv's first token at 32K with the tree before (BEFORE=folder) and this one, in turn, twice.
# PART=t: depthweave-kv's first token at 32K, profiled by stage (profile_prefill.py: the probe is `encoder.probe`),
#         and against the full cache's (decode_e2e.py --ttft).
# Run from the repository's root: OUT=folder PART=c|g|b|t [BEFORE=folder] bash docs/perf/gpu-2026-12-05-late/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
# each step's output without Triton's and torch's warnings; pytest's summary line is kept
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i -E "warn(ing)?:|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
if [ "${PART:-c}" = c ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_combine_pass.py tests/test_kernels.py tests/test_fused_contract.py tests/test_programmatic_launch.py
  step 330 fused-combines.txt python benchmarks/decode_kernel.py --tokens "${TOKENS:-32768,131072}" --batches "${BATCHES:-1,8}" \
    --combines "${COMBINES:-two-pass,one-pass,one-pass/8}" --reps 20 --out "$OUT/json-combines"
elif [ "$PART" = g ]; then
  step 200 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_combine_pass.py tests/test_kernels.py tests/test_fused_contract.py tests/test_programmatic_launch.py tests/test_graphs_gpu.py
elif [ "$PART" = b ]; then  # the tree before (BEFORE=folder holding it, imported as kvweave) and this one, in turn
  mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
  for round in 1 2; do
    step 150 ab-ttft.txt env PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python $BEFORE/benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-before-ttft
    step 150 ab-ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-ttft
  done
elif [ "$PART" = t ]; then
  step 300 prefill-dw.txt python benchmarks/profile_prefill.py --tokens 32768 --ops 40
  step 300 ttft.txt python benchmarks/decode_e2e.py --methods full,depthweave-kv --ttft 32768 --batches "" --out /tmp/kvweave-ttft
  cat /tmp/kvweave-ttft/decode_e2e.md >> "$OUT/ttft.txt" 2>/dev/null
fi
