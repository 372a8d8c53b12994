#!/usr/bin/env bash
# The quality-at-ratio frontier (docs/frontier.md): query-agnostic needles at 2,000 and 5,000 tokens
# (NEEDLES distinct needles x depths 0.1/0.5/0.9; 16 needles = 48 cases per length by default) and perplexity
# at 8,000 tokens against the full cache, for every pipeline named, on one model; then the table and plot.
#   bash benchmarks/frontier_eval.sh MODEL OUT PIPELINES [REGISTRY]
# e.g. bash benchmarks/frontier_eval.sh default results/frontier-smollm full,int4,prerope-qa35v3
# PIPELINES `all`: every pipeline the registry defines (`kvweave pipelines`, with REGISTRY read on top).
# Environment: NEEDLES (16), LENGTHS (2000,5000), DEPTHS (0.1,0.5,0.9), TOKENS (8000), DTYPE (bfloat16), DEVICE (cuda), JOBS (1),
# PREFILL (0: perplexity of every token fed in chunks; N: the first N tokens one forward, a context that
# pipelines evicting by context importance need, and perplexity of the tokens after it):
# JOBS=3 runs the needle grid as 3 processes on the same device, each a share of the pipelines (small models
# leave a large GPU mostly idle); the parts are merged by frontier_plot.py.
# SPLIT=cells runs one process per (pipeline, length, depth) instead, JOBS at a time, and joins each pipeline's
# parts with `kvweave eval merge` into OUT/PIPELINE (the 90-case grids of docs/frontier.md: NEEDLES=30), and
# measures perplexity one process per pipeline too (OUT/ppl/PIPELINE, one protocol, joined by frontier_plot.py).
set -euo pipefail
model=${1:?model (default, a .gguf file or an HF folder)}
out=${2:?results folder}
pipelines=${3:?comma-separated pipelines}
registry=${4:-}
device=${DEVICE:-cuda}
needles=${NEEDLES:-16}
jobs=${JOBS:-1}
lengths=${LENGTHS:-2000,5000}
depths=${DEPTHS:-0.1,0.5,0.9}
tokens=${TOKENS:-8000}
dtype=${DTYPE:-bfloat16}
prefill=${PREFILL:-0}
extra=()
[ -n "$registry" ] && extra=(--registry "$registry")
if [ "$pipelines" = all ]; then
  pipelines=$(kvweave pipelines --json "${extra[@]}" | python -c 'import json, sys; print(",".join(p["name"] for p in json.load(sys.stdin)))')
fi
IFS=, read -ra names <<< "$pipelines"
echo "frontier_eval: ${#names[@]} pipelines: $pipelines" >&2
case " ${names[*]} " in *" full "*) ;; *) echo "frontier_eval: add 'full' to the pipelines: 'of full' counts the cases it answers" >&2; exit 2;; esac
(( jobs < 1 )) && { echo "frontier_eval: JOBS must be at least 1, got $jobs" >&2; exit 2; }
split=${SPLIT:-pipelines}
case $split in pipelines|cells) ;; *) echo "frontier_eval: SPLIT must be 'pipelines' or 'cells', got '$split'" >&2; exit 2;; esac
# background processes: at most JOBS at a time; one that failed stops the script, saying where its error is
failed() { echo "frontier_eval: a $1 process failed ($2)" >&2; exit 1; }
throttle() { while (( $(jobs -rp | wc -l) >= jobs )); do wait -n || failed "$@"; done; }
drain() { for pid in $(jobs -p); do wait "$pid" || failed "$@"; done; }
parts=()
if [ "$split" = cells ]; then
  IFS=, read -ra lens <<< "$lengths"
  IFS=, read -ra deps <<< "$depths"
  mkdir -p "$out/cells"
  for name in "${names[@]}"; do
    for L in "${lens[@]}"; do for D in "${deps[@]}"; do
      throttle needle "logs in $out/cells"
      cell="$out/cells/$name-$L-$D"
      kvweave eval needle --model "$model" --device "$device" --dtype "$dtype" "${extra[@]}" --pipelines "$name" \
        --lengths "$L" --depths "$D" --needles "$needles" --out "$cell" > "$cell.log" 2>&1 &
    done; done
  done
  drain needle "logs in $out/cells"
  for name in "${names[@]}"; do
    cells=()
    for L in "${lens[@]}"; do for D in "${deps[@]}"; do cells+=("$out/cells/$name-$L-$D"); done; done
    rm -rf "${out:?}/$name"  # joined from the cells again: a rerun into OUT keeps the cells that completed, runs the rest
    if (( ${#cells[@]} == 1 )); then  # one length and one depth: the cell is the pipeline's folder (merge joins two or more)
      cp -r "${cells[0]}" "$out/$name"
    else
      kvweave eval merge "$out/$name" "${cells[@]}"
    fi
    parts+=("$out/$name")
  done
else
  for (( j = 0; j < jobs; j++ )); do
    share=()
    for (( i = j; i < ${#names[@]}; i += jobs )); do share+=("${names[i]}"); done
    (( ${#share[@]} )) || continue
    part="$out/needle-part$j"
    parts+=("$part")
    kvweave eval needle --model "$model" --device "$device" --dtype "$dtype" "${extra[@]}" \
      --pipelines "$(IFS=,; echo "${share[*]}")" --lengths "$lengths" --depths "$depths" --needles "$needles" --out "$part" &
  done
  drain needle "its error is above"
fi
compressed=$(IFS=,; echo "${names[*]}" | sed -e 's/^full,//' -e 's/,full,/,/' -e 's/,full$//')
ppl=("$out/ppl")
if [ "$split" = cells ]; then
  ppl=()
  IFS=, read -ra each <<< "$compressed"
  mkdir -p "$out/ppl"
  for name in "${each[@]}"; do
    throttle perplexity "logs in $out/ppl"
    kvweave eval ppl --model "$model" --device "$device" --dtype "$dtype" "${extra[@]}" --pipelines "$name" \
      --tokens "$tokens" --prefill "$prefill" --out "$out/ppl/$name" > "$out/ppl/$name.log" 2>&1 &
    ppl+=("$out/ppl/$name")
  done
  drain perplexity "logs in $out/ppl"
else
  kvweave eval ppl --model "$model" --device "$device" --dtype "$dtype" "${extra[@]}" --pipelines "$compressed" \
    --tokens "$tokens" --prefill "$prefill" --out "$out/ppl"
fi
python "$(dirname "$0")/frontier_plot.py" "${parts[@]}" "${ppl[@]}" --out "$out/frontier.png" | tee "$out/frontier.md"
