#!/bin/bash
# Run 9: the tiles pass with its registers bounded (GPU test, then each bound in turn against none), and the
# ~5x class's storage at B = 32 (the grid), the dense kernel. Output under $OUT (or ./out).
OUT=${OUT:-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python -m pytest -q tests/test_tiles_pass.py -k bounded 2>&1 | tail -2 | tee "$OUT/run9-tests.txt"
python docs/perf/h200-2026-12-05-switches/ab_registers.py 32768x1,32768x8,131072x1,131072x8,131072x32 128 2>&1 | grep "^T=" | tee "$OUT/run9-registers.txt"
python benchmarks/lowbit_kernel.py --post-rope --reps 10 --configs dense:64:4 --storage k4v4e77t --tokens 32768,65536,131072 --batches 32 --out "$OUT/run9-k4v4e77t" 2>&1 | grep "^|" | tee "$OUT/run9-k4v4e77t.txt"
