#!/bin/bash
# Where the dense kernel's call goes among its programs (benchmarks/dense_timeline.py), every call past the L2 cache:
# the 8x class's storage at B = 1, 8 and 32 from 32K to 128K, the ~5x class's at B = 1 and 8; before it, the GPU tests
# of the timeline and of the combine launched early.
# OUT=/tmp/o timeout 560 bash docs/perf/gpu-2026-12-07-timeline/lease.sh
source benchmarks/lease_preamble.sh
step 200 tests.md python -m pytest -q -p no:cacheprovider tests/test_timeline.py tests/test_programmatic_launch.py -k gpu
step 200 k4v2e48t.md python benchmarks/dense_timeline.py --storage k4v2e48t --tokens ${TOKENS:-32768,65536,131072} \
  --batches ${BATCHES:-1,8,32} --cold-l2 --out "$OUT/k4v2e48t"
step 120 k4v4e77t.md python benchmarks/dense_timeline.py --storage k4v4e77t --tokens 32768,65536 --batches 1,8 --cold-l2 \
  --out "$OUT/k4v4e77t"
