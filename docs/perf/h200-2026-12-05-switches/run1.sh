#!/bin/bash
# Run 1: the GPU tests of the tiles pass, the kept window's fill and depthweave-kv's graphs; the tiles pass's two
# switches in turn; the flush's statistics by either pass. Output under $OUT (or ./out).
OUT=${OUT:-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
git log -1 --format='tree of %h %s' | tee -a "$OUT/gpu.txt"
{ python -m pytest -q tests/test_tiles_pass.py tests/test_kernels.py 2>&1 | tail -6
  python -m pytest -q tests/test_graphs.py -k "depthweave or gpu" 2>&1 | tail -8; } | tee "$OUT/run1-tests.txt"
python docs/perf/h200-2026-12-04-pairs/ab_switches.py 32768x1,32768x8,131072x1,131072x8,131072x32 2>&1 | tee "$OUT/run1-switches.txt"
python docs/perf/h200-2026-12-04-pairs/lse_variants.py 65536 1,8,32 8 2>&1 | tee "$OUT/run1-lse.txt"
