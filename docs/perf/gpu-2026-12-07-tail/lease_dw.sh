#!/bin/bash
# Where depthweave-kv's decode call spends its time among the tiles pass's programs (dense_timeline.py --method
# depthweave-kv), and the dense kernel's one-row calls program by program (the 8x class's storage).
# OUT=/tmp/o timeout 420 bash docs/perf/gpu-2026-12-07-tail/lease_dw.sh   (TOKENS=32768: one length; DW_LIMIT: its step's seconds)
source benchmarks/lease_preamble.sh
step ${DW_LIMIT:-260} dw.md python benchmarks/dense_timeline.py --method depthweave-kv --tokens ${TOKENS:-32768,65536} --batches 1,8,32 \
  --calls 5 --cold-l2 --out "$OUT/dw"
step 100 dense-b1.md python benchmarks/dense_timeline.py --storage k4v2e48t --tokens 32768,65536 --batches 1 \
  --calls 5 --cold-l2 --out "$OUT/dense-b1"
