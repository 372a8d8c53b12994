#!/bin/bash
# depthweave-kv's tiles pass at other splits (tokens a program), the cache's own segments first in each cell, every call
# its own copy past the L2 cache: how many programs an SM and how many waves its decode call is fastest at.
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-splits/lease.sh   (NO_B1=1: B = 8 and 32 only)
source benchmarks/lease_preamble.sh
step ${WIDE_LIMIT:-330} dw-b8-b32.md python benchmarks/decode_kernel.py --tokens ${TOKENS:-32768,65536} --batches 8,32 --reps 20 \
  --cold-l2 --split ${SPLITS:-0,1376,2048,2752,4096,5472} --out "$OUT/dw-b8-b32"
if [ -z "$NO_B1" ]; then
  step 150 dw-b1.md python benchmarks/decode_kernel.py --tokens ${TOKENS:-32768,65536} --batches 1 --reps 20 --cold-l2 \
    --split ${B1_SPLITS:-0,192,224,320,384} --out "$OUT/dw-b1"
fi
