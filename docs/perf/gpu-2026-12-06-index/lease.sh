#!/bin/bash
# The tiles pass's tile index read two steps ahead (TILES_INDEX) and its query's products after the first step's loads
# (TILES_QUERY_LATE), against the default build, on one lease: ab_switches.py at five shapes (the defaults, each
# switch), then the GPU tests of the switches' output bits and the builds' counts on the GPU's Triton (sass_index.py).
# Run from the repository's root: OUT=folder bash docs/perf/gpu-2026-12-06-index/lease.sh
source benchmarks/lease_preamble.sh
step 300 run1-ab.md python docs/perf/gpu-2026-12-06-words/ab_switches.py \
  32768x1,32768x8,131072x1,131072x8,131072x32 - TILES_QUERY_LATE=1 TILES_INDEX=1
step 150 run1-tests.txt python -m pytest -q -p no:cacheprovider tests/test_tiles_bytes.py -k "moved and not REGISTERS"
step 100 run1-sass.txt python docs/perf/gpu-2026-12-06-index/sass_index.py 0:none:0 1:none:0 0:none:1
