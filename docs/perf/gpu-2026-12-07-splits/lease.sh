#!/bin/bash
# depthweave-kv's tiles pass at other splits (tokens a program), the cache's own segments first in each cell, every call
# its own copy past the L2 cache: how many programs an SM and how many waves its decode call is fastest at.
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-splits/lease.sh   (NO_B1=1: B = 8 and 32 only)
# PART=tail: the pass launched segment-major with each row's last wave of segments shorter (KVWEAVE_TILES_TAIL 0, 100,
# 33, 25 in turn; kvweave.kernels.tiles_tail) at B = 8 and 32, after its GPU test.
source benchmarks/lease_preamble.sh
if [ "$PART" = tail ]; then
  step 60 tail-test.md python -m pytest -q -p no:cacheprovider tests/test_tiles_tail.py
  for tail in 0 100 33 25; do
    KVWEAVE_TILES_TAIL=$tail step ${TAIL_LIMIT:-120} dw-tail$tail.md python benchmarks/decode_kernel.py \
      --tokens ${TOKENS:-32768,65536} --batches 8,32 --reps 20 --cold-l2 --out "$OUT/dw-tail$tail"
  done
  exit
fi
step ${WIDE_LIMIT:-330} dw-b8-b32.md python benchmarks/decode_kernel.py --tokens ${TOKENS:-32768,65536} --batches 8,32 --reps 20 \
  --cold-l2 --split ${SPLITS:-0,1376,2048,2752,4096,5472} --out "$OUT/dw-b8-b32"
if [ -z "$NO_B1" ]; then
  step 150 dw-b1.md python benchmarks/decode_kernel.py --tokens ${TOKENS:-32768,65536} --batches 1 --reps 20 --cold-l2 \
    --split ${B1_SPLITS:-0,192,224,320,384} --out "$OUT/dw-b1"
fi
