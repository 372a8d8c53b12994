#!/usr/bin/env bash
# Every decode-kernel measurement of docs/kernels.md's lowbit sections in one run on a GPU machine: the kernels as
# the GPU compiles them against their torch twin (tests/test_lowbit_gpu.py), then each storage timed against SDPA
# (Llama-3-8B attention shape) without and with the conversion tricks, and the keys-after-RoPE paths.
#   bash benchmarks/kernel_suite.sh OUT
# Environment: TOKENS (32768,65536,131072), BATCHES (1,8,32), REPS (20), STORAGES (kz8,kz5,k4v2,qa35v3),
# CONFIGS (wide:32:4,wide:32:4:528:magic,wide:32:4:528:magic+vb16,wide:32:4:528:ktf32,wide:32:4:528:magic+vb16+ktf32),
# POST_CONFIGS (wide:32:4,wide:32:4:528:magic+vb16,wide:32:4:528:kfold+vb16), DRY=1 prints the commands only.
# OUT/NAME.log holds each step's table, OUT/NAME/lowbit_kernel.json its rows; a failed step is said and the rest run.
set -uo pipefail
out=${1:?results folder}
tokens=${TOKENS:-32768,65536,131072}
batches=${BATCHES:-1,8,32}
reps=${REPS:-20}
storages=${STORAGES:-kz8,kz5,k4v2,qa35v3}
configs=${CONFIGS:-wide:32:4,wide:32:4:528:magic,wide:32:4:528:magic+vb16,wide:32:4:528:ktf32,wide:32:4:528:magic+vb16+ktf32}
post=${POST_CONFIGS:-wide:32:4,wide:32:4:528:magic+vb16,wide:32:4:528:kfold+vb16}
here=$(cd "$(dirname "$0")" && pwd)
failed=()
step() {  # step NAME COMMAND...: run it (or print it with DRY=1), its output in OUT/NAME.log
  local name=$1; shift
  if [ "${DRY:-0}" = 1 ]; then echo "$*"; return; fi
  echo "kernel_suite: $name ($(date -u +%H:%M:%S))" >&2
  "$@" > "$out/$name.log" 2>&1 || { failed+=("$name"); echo "kernel_suite: $name failed, see $out/$name.log" >&2; }
}
IFS=, read -ra each <<< "$storages"
known=$(cd "$here" && python -c 'import lowbit_kernel; print(" ".join(lowbit_kernel.STORAGES))') || exit 2
for storage in "${each[@]}"; do
  case " $known " in *" $storage "*) ;; *) echo "kernel_suite: STORAGES names '$storage'; known: $known" >&2; exit 2;; esac
done
if [ "${DRY:-0}" != 1 ]; then
  python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || { echo "kernel_suite: times CUDA kernels and no CUDA GPU is visible; DRY=1 prints the commands" >&2; exit 2; }
  mkdir -p "$out"
fi
step gpu-tests python -m pytest -q "$here/../tests/test_lowbit_gpu.py"
for storage in "${each[@]}"; do
  step "$storage" python "$here/lowbit_kernel.py" --storage "$storage" --tokens "$tokens" --batches "$batches" --reps "$reps" \
    --configs "$configs" --out "$out/$storage"
done
step post-rope python "$here/lowbit_kernel.py" --post-rope --tokens "$tokens" --batches "$batches" --reps "$reps" \
  --configs "$post" --out "$out/post-rope"
if (( ${#failed[@]} )); then echo "kernel_suite: failed: ${failed[*]}" >&2; exit 1; fi
