#!/bin/bash
# The first token at 32K with every layer's slot counts decided at the ingest's first flush (one host read), against
# the tree before (BEFORE=folder holding it) in the same lease. PART=a: the first tokens (full cache, the 8x storage
# scored by a surrogate, depthweave-kv), the tree before's, where the surrogate pipeline's first token goes, and the
# packing kernels' and the together store's tests on the GPU.
# PART=b: storing the scored context layer by layer against together (time, peak, identical bytes), and where
# depthweave-kv's first token goes. SMOKE=1 runs the same on the tiny CPU model (checks the script).
# Run from the repository's root: OUT=folder PART=a|b [BEFORE=folder] bash docs/perf/h100-2026-12-05-plan/lease.sh
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
METHODS=full,kzd-k4v2-f48-d128-s,depthweave-kv
if [ "${PART:-a}" = a ]; then
  step 170 ttft.txt python benchmarks/decode_e2e.py $S --registry $REG/registry.toml --methods $METHODS --ttft $T --batches "" --out /tmp/kvweave-ttft
  cat /tmp/kvweave-ttft/decode_e2e.md >> "$OUT/ttft.txt" 2>/dev/null
  if [ -n "$BEFORE" ]; then  # the tree before, imported as kvweave from a folder of its own
    mkdir -p /tmp/kvweave-before && ln -sfn "$(cd "$BEFORE" && pwd)" /tmp/kvweave-before/kvweave
    step 170 before-ttft.txt env PYTHONPATH=/tmp/kvweave-before:$BEFORE/benchmarks python $BEFORE/benchmarks/decode_e2e.py $S --registry $REG/registry.toml --methods $METHODS --ttft $T --batches "" --out /tmp/kvweave-before-ttft
    cat /tmp/kvweave-before-ttft/decode_e2e.md >> "$OUT/before-ttft.txt" 2>/dev/null
  fi
  step 90 prefill-s.txt python benchmarks/profile_prefill.py $S --registry $REG/registry.toml --pipeline kzd-k4v2-f48-d128-s --tokens $T --ops 30
  [ -z "$SMOKE" ] && step 150 gpu-tests.txt python -m pytest -q -p no:cacheprovider tests/test_pack_kernels.py tests/test_together.py tests/test_ingest.py tests/test_first_token.py
else
  step 120 together.txt python benchmarks/ingest_together.py $S --registry $REG/registry.toml --tokens $T --pass-mib 1024,512,256
  step 150 prefill-dw.txt python benchmarks/profile_prefill.py $S --registry $REG/registry.toml --pipeline depthweave-kv --tokens $T --ops 30
fi
