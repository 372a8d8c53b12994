#!/bin/bash
# One lease, in order of need (each step capped so the whole ends inside a 10-minute call): storing the surrogate
# pipeline's scored 32K context layer by layer against together (time, peak memory, identical bytes); the first token
# at 32K of the full cache, the 8x storage scored by a surrogate, depthweave-kv and the 8x storage scored by KVzip;
# where the surrogate pipeline's first token goes; the same first tokens on the tree before (BEFORE=folder holding
# it, optional). SMOKE=1 runs the same on the tiny CPU model (checks the script).
# Run from the repository's root: OUT=folder [BEFORE=folder] bash docs/perf/h200-2026-12-05-together/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
S=${SMOKE:+--smoke}
T=${SMOKE:+256}; T=${T:-32768}
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv 2>/dev/null; python -c "import torch, triton; print(torch.__version__, triton.__version__)"; } > "$OUT/gpu.txt"
REG=/tmp/kvweave-surrogate-registry
python benchmarks/surrogate_registry.py --out $REG $S > /dev/null
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -i warn >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
step 120 together.txt python benchmarks/ingest_together.py $S --registry $REG/registry.toml --tokens $T --pass-mib 1024,512,256
step 190 ttft.txt python benchmarks/decode_e2e.py $S --registry $REG/registry.toml --methods full,kzd-k4v2-f48-d128-s,depthweave-kv --ttft $T --batches "" --out /tmp/kvweave-ttft
cat /tmp/kvweave-ttft/decode_e2e.md >> "$OUT/ttft.txt" 2>/dev/null
step 80 prefill-s.txt python benchmarks/profile_prefill.py $S --registry $REG/registry.toml --pipeline kzd-k4v2-f48-d128-s --tokens $T --ops 30
if [ -n "$BEFORE" ]; then  # the tree before, imported as kvweave from a folder of its own
  mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
  step 110 before-ttft.txt env PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python $BEFORE/benchmarks/decode_e2e.py $S --registry $REG/registry.toml --methods full,kzd-k4v2-f48-d128-s,depthweave-kv --ttft $T --batches "" --out /tmp/kvweave-before-ttft
  cat /tmp/kvweave-before-ttft/decode_e2e.md >> "$OUT/before-ttft.txt" 2>/dev/null
fi
