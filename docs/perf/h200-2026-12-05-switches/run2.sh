#!/bin/bash
# Run 2: model.generate at 64K (Llama-3-8B shape, random bf16 weights) with depthweave-kv, its decode steps replayed
# from CUDA graphs and eager, B = 1, 4, 8, and the full cache at the same batches. Output under $OUT (or ./out).
OUT=${OUT:-out}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python benchmarks/decode_e2e.py --methods depthweave-kv@graphs,depthweave-kv,full --batches 1,4,8 --steps 72 --out "$OUT/run2-e2e" 2>&1 | grep -v Warning | tail -30
