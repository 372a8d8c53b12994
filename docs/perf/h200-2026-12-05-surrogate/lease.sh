#!/bin/bash
# One lease, in order of need (each step capped so the whole ends inside a 10-minute call): the first token at 32K of
# the full cache, depthweave-kv (after the grouped flush), the 8x storage scored by KVzip and by a surrogate; where the
# surrogate pipeline's and depthweave-kv's first tokens go; depthweave-kv's decode steps with flushes under graphs;
# a profiled flush at B = 1. SMOKE=1 runs the same on the tiny CPU model (checks the script).
# Run from the repository's root: OUT=folder bash docs/perf/h200-2026-12-05-surrogate/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
S=${SMOKE:+--smoke}
T=${SMOKE:+256}; T=${T:-32768}
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
REG=/tmp/kvweave-surrogate-registry
python benchmarks/surrogate_registry.py --out $REG $S > /dev/null
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" > "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i warn >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
step 180 ttft.txt python benchmarks/decode_e2e.py $S --registry $REG/registry.toml --methods full,depthweave-kv,kzd-k4v2-f48-d128,kzd-k4v2-f48-d128-s --ttft $T --batches "" --out /tmp/kvweave-ttft
cat /tmp/kvweave-ttft/decode_e2e.md >> "$OUT/ttft.txt" 2>/dev/null
step 80 prefill-s.txt python benchmarks/profile_prefill.py $S --registry $REG/registry.toml --pipeline kzd-k4v2-f48-d128-s --tokens $T --ops 30
step 80 prefill-dw.txt python benchmarks/profile_prefill.py $S --tokens $T --ops 40
step 120 e2e-graphs.txt python benchmarks/decode_e2e.py $S --methods depthweave-kv@graphs --batches 1,8 --steps 72 --out /tmp/kvweave-e2e
cat /tmp/kvweave-e2e/decode_e2e.md >> "$OUT/e2e-graphs.txt" 2>/dev/null
step 60 flush-profile.txt python benchmarks/profile_decode.py $S --method depthweave-kv --batch 1 --steps 33 --warmup 3 --top 25
