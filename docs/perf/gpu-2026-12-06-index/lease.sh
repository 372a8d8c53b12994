#!/bin/bash
# The tiles pass's tile index read two steps ahead (TILES_INDEX) and its query's products after the first step's loads
# (TILES_QUERY_LATE), against the default build, on one lease: ab_switches.py at five shapes (the defaults, each
# switch), then the GPU tests of the switches' output bits and the builds' counts on the GPU's Triton (sass_index.py).
# Run from the repository's root: OUT=folder bash docs/perf/gpu-2026-12-06-index/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu.txt"
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
step 300 run1-ab.md python docs/perf/gpu-2026-12-06-words/ab_switches.py \
  32768x1,32768x8,131072x1,131072x8,131072x32 - TILES_QUERY_LATE=1 TILES_INDEX=1
step 150 run1-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tiles_bytes.py -k "moved and not REGISTERS"
step 100 run1-sass.txt python docs/perf/gpu-2026-12-06-index/sass_index.py 0:none:0 1:none:0 0:none:1
