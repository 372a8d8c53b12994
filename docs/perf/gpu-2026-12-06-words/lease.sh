#!/bin/bash
# The tiles pass's pairs form (TILES_PAIRS) and its codes as 32-bit words (TILES_WORDS) timed, and the kernel bars'
# cells refreshed on the current build. The pairs form existed only in commits 376a0b2 to d78507a (run 1 ran on
# d78507a's tree); runs 2-5 on the tree with TILES_WORDS = 2 (the pairs form off).
# PART=a: the build's counts (sass_pairs.py); the GPU tests of the pairs form, the byte permutes and the dense kernel's
#   rule (4-bit values included); ab_switches.py at four shapes: the defaults, the pairs form (also without its words
#   a step ahead), the words a step ahead; depthweave-kv at 64K.
# PART=b: lowbit_kernel.py over the 8x and ~5x classes (the launch's choice, dense:64:4) at 64K for B = 1, 8, 32 and
#   at 32K and 128K for B = 32: the cells whose last figure came from an older build.
# PART=c: the 8x class at 32K, B = 8 and 32, at the launch's programs and at 1,320, 1,980 and 3,300 (2, 3 and 5 waves).
# PART=d: the tiles pass's registers capped (TILES_REGISTERS 144 and 128) against the compiler's choice, and its GPU test.
# PART=e: the tiles pass at 32 tokens a step (127 registers on Triton 3.9, 16 programs an SM) against 64, one and two
#   warps a program, at 128K B = 8 and 32 and 32K B = 1 (kernel_tuning.py, device time).
# Run from the repository's root: OUT=folder PART=a|b|c|d|e bash docs/perf/gpu-2026-12-06-words/lease.sh
set -o pipefail
OUT=${OUT:-$PWD/results/lease}; PART=${PART:-a}
mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } > "$OUT/gpu-$PART.txt"
step() { local limit=$1 file=$2; shift 2; echo "\$ $*" >> "$OUT/$file"; timeout "$limit" "$@" 2>&1 | grep -v -E "Warning|warnings.warn" >> "$OUT/$file"; echo "exit $? after ${SECONDS}s" >> "$OUT/$file"; }
if [ "$PART" = a ]; then
  step 100 run1-sass.txt python docs/perf/gpu-2026-12-06-words/sass_pairs.py
  step 150 run1-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tiles_pairs.py tests/test_tiles_bytes.py \
    tests/test_dense_ahead.py
  step 300 run1-ab.md python docs/perf/gpu-2026-12-06-words/ab_switches.py 32768x1,32768x8,131072x1,131072x8 \
    - TILES_PAIRS=1 TILES_PAIRS=1+TILES_AHEAD=0 TILES_WORDS=2
  step 150 run1-decode_kernel.txt python benchmarks/decode_kernel.py --tokens 65536 --batches 1,8,32 --variants tiles \
    --reps 20 --out "$OUT/run1-json"
elif [ "$PART" = b ]; then
  for storage in k4v2e48t k4v4e77t; do
    for shape in "65536 1,8,32" "32768,131072 32"; do
      set -- $shape
      step 200 "run2-kernel-$storage.txt" python benchmarks/lowbit_kernel.py --post-rope --reps 10 --storage $storage \
        --configs dense:64:4 --tokens $1 --batches $2 --out "$OUT/run2-json-$storage-${1%%,*}"
    done
  done
fi
if [ "$PART" = c ]; then  # the 8x class's programs at the shapes just short of the bar (B = 8 and 32 at 32K)
  step 200 run6-programs.txt python benchmarks/lowbit_kernel.py --post-rope --reps 10 --storage k4v2e48t --tokens 32768 \
    --batches 8,32 --configs dense:64:4,dense:64:4:1320,dense:64:4:1980,dense:64:4:3300 --out "$OUT/run6-json"
fi
if [ "$PART" = d ]; then  # more one-warp programs an SM for the latency-bound tiles pass, at a few spilled registers
  step 150 run7-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tiles_bytes.py -k "cap or gpu"
  step 300 run7-ab.md python docs/perf/gpu-2026-12-06-words/ab_switches.py 32768x1,32768x8,131072x1,131072x8,131072x32 \
    - TILES_REGISTERS=144 TILES_REGISTERS=128
fi
if [ "$PART" = e ]; then  # half the step, no cap: 16 programs an SM without spills
  for shape in "131072 8" "131072 32" "32768 1"; do
    set -- $shape
    step 200 run8-blocks.txt python benchmarks/kernel_tuning.py --variant tiles --tokens $1 --batch $2 --blocks 32,64 \
      --warps 1,2 --stages 1 --splits 0 --reps 20
  done
fi
