#!/usr/bin/env bash
# Time to first token at 32K on the Llama-3-8B shape (random bf16 weights): the full cache, the 8x storage scored by
# KVzip's repetitions (kzd-k4v2-f48-d128) and the same storage scored by a surrogate (kzd-k4v2-f48-d128-s: one forward,
# ingested); then where the surrogate pipeline's first token goes. Run from the repository's root on the GPU machine.
set -euo pipefail
OUT=${OUT:-$PWD/results/surrogate-ttft}
mkdir -p "$OUT"
python benchmarks/surrogate_registry.py --out "$OUT/registry" 2>&1 | tee "$OUT/registry.txt"
python benchmarks/decode_e2e.py --registry "$OUT/registry/registry.toml" --methods full,kzd-k4v2-f48-d128,kzd-k4v2-f48-d128-s \
  --ttft 32768 --batches "" --out "$OUT/e2e" 2>&1 | tee "$OUT/ttft.txt"
python benchmarks/profile_prefill.py --registry "$OUT/registry/registry.toml" --pipeline kzd-k4v2-f48-d128-s --tokens 32768 \
  --ops 30 2>&1 | tee "$OUT/prefill-s.txt"
