#!/usr/bin/env bash
# The quality-at-ratio frontier (docs/frontier.md): query-agnostic needles at 2,000 and 5,000 tokens
# (8 distinct needles x depths 0.1/0.5/0.9 = 24 cases per length) and perplexity at 8,000 tokens against
# the full cache, for every pipeline named, on one model.
#   bash benchmarks/frontier_eval.sh MODEL OUT PIPELINES [REGISTRY]
# e.g. bash benchmarks/frontier_eval.sh default results/frontier-smollm full,int4,kq3-vq2
set -euo pipefail
model=${1:?model (default, a .gguf file or an HF folder)}
out=${2:?results folder}
pipelines=${3:?comma-separated pipelines}
registry=${4:-}
device=${DEVICE:-cuda}
extra=()
[ -n "$registry" ] && extra=(--registry "$registry")
kvweave eval needle --model "$model" --device "$device" --dtype bfloat16 "${extra[@]}" --pipelines "$pipelines" \
  --lengths 2000,5000 --depths 0.1,0.5,0.9 --needles 8 --out "$out/needle"
kvweave eval ppl --model "$model" --device "$device" --dtype bfloat16 "${extra[@]}" --pipelines "$pipelines" \
  --tokens 8000 --out "$out/ppl"
