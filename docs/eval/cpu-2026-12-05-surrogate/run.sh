#!/usr/bin/env bash
# KVzip's scores against the one-forward surrogate's, query-agnostic needles and perplexity, SmolLM2-135M-Instruct and
# Gemma-3-270m, on a CPU (bfloat16). Run from the repository's root: bash docs/eval/cpu-2026-12-05-surrogate/run.sh
# GEMMA: the Gemma-3-270m GGUF file (docs/../shared/ENVIRONMENT.md says how to join its parts).
set -euo pipefail
OUT=${OUT:-docs/eval/cpu-2026-12-05-surrogate}
GEMMA=${GEMMA:-/tmp/gem/gemma-3-270m-q4_k_m.gguf}
NEEDLES=${NEEDLES:-10}
S="kvzip-qa3-vl25-smollm2,kvzip-surrogate-qa3-vl25-smollm2"
G="g-kz-qa35v3-f50-st192,g-kzs-qa35v3-f50-st192"

kvweave eval needle --model default --device cpu --dtype bfloat16 --lengths 2000 --depths 0.1,0.5,0.9 \
  --needles "$NEEDLES" --pipelines "full,$S" --out "$OUT/smollm-needle"
kvweave train-scorer --model "$GEMMA" --dtype bfloat16 --out "$OUT/gemma-3-270m.pt"
cat benchmarks/lean_sweep.toml "$OUT/gemma-surrogate.toml" > "$OUT/gemma-registry.toml"
kvweave eval needle --model "$GEMMA" --device cpu --dtype bfloat16 --registry "$OUT/gemma-registry.toml" --lengths 2000 \
  --depths 0.1,0.5,0.9 --needles "$NEEDLES" --pipelines "full,$G" --out "$OUT/gemma-needle"
kvweave eval ppl --model default --device cpu --dtype bfloat16 --tokens 8000 --prefill 4000 --pipelines "$S" --out "$OUT/smollm-ppl"
kvweave eval ppl --model "$GEMMA" --device cpu --dtype bfloat16 --registry "$OUT/gemma-registry.toml" --tokens 8000 \
  --prefill 4000 --pipelines "$G" --out "$OUT/gemma-ppl"
# 5,000 tokens: the full cache and the surrogate on the CPU; KVzip's cells of the same needles are the H200's
# (docs/eval/h200-2026-12-02-8x/smollm/kz-qa3-vl25-f48-cp, needles 0-9), which agree with the CPU's on 28 of 30 cells at 2,000
kvweave eval needle --model default --device cpu --dtype bfloat16 --lengths 5000 --depths 0.1,0.5,0.9 \
  --needles "$NEEDLES" --pipelines "full,kvzip-surrogate-qa3-vl25-smollm2" --out "$OUT/smollm-needle-5000"
