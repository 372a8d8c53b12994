#!/bin/bash
# depthweave-kv's tiles pass built for sm_90 without a GPU by Triton 3.9 (installed here, as on CI) and 3.6 (the GPU
# machine's; `pip install --target /tmp/t36 --no-deps triton==3.6.0`) at the compiler's registers, 168 and 160:
#   T36=/tmp/t36 bash docs/perf/gpu-2026-12-07-tiles-regs/sass.sh > docs/perf/gpu-2026-12-07-tiles-regs/sass-cpu.txt
for triton in installed "${T36:-/tmp/t36}"; do
  path=$([ "$triton" = installed ] || echo "$triton")
  PYTHONPATH=$path python -c "import triton; print('== Triton', triton.__version__)"
  for regs in 0 168 160; do
    echo "-- KVWEAVE_TILES_REGISTERS=$regs (0: the compiler's choice), batch 1, tokens 2048"
    PYTHONPATH=$path KVWEAVE_TILES_REGISTERS=$regs python benchmarks/kernel_sass.py --method depthweave-kv --tokens 2048 \
      2>&1 | grep -E "^\| dep"
  done
done
