#!/bin/bash
# The tiles pass's int8 coefficients by byte permutes and its value coefficients loaded token-major: the build's counts
# on the GPU machine's Triton, the GPU tests, and each setting in turn on depthweave-kv's storage. Output under $OUT.
#   OUT=... PART=a bash docs/perf/gpu-2026-12-06-bytes/lease.sh
OUT=${OUT:-out}; PART=${PART:-a}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu-$PART.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu-$PART.txt"
git log -1 --format='tree of %h %s' | tee -a "$OUT/gpu-$PART.txt"
D=docs/perf/gpu-2026-12-06-bytes
if [ "$PART" = a ]; then
  python $D/sass_bytes.py 2>&1 | grep -v -i warn | tee "$OUT/run1-sass.txt"
  python -m pytest -q tests/test_tiles_bytes.py tests/test_tiles_pass.py tests/test_kernels.py 2>&1 | tail -6 | tee "$OUT/run1-tests.txt"
  python $D/ab_bytes.py 32768x1,32768x8,131072x1,131072x8 2>&1 | tee "$OUT/run1-ab.md"
fi
