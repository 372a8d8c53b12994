#!/bin/bash
# The dense kernel's and depthweave-kv's tiles pass's sm_90 builds by Triton 3.9 (installed here, as on CI) and 3.6 (the
# GPU machine's; `pip install --target /tmp/t36 --no-deps triton==3.6.0`), without a GPU: at the launch's register
# caps, at 168 and at 255 (KVWEAVE_DENSE_REGISTERS), one row of 512 tokens (one wave) and 8 rows of 32K (several).
#   T36=/tmp/t36 bash docs/perf/gpu-2026-12-07-triton39/sass.sh > docs/perf/gpu-2026-12-07-triton39/sass-cpu.txt
for triton in installed "${T36:-/tmp/t36}"; do
  path=$([ "$triton" = installed ] || echo "$triton")
  PYTHONPATH=$path python -c "import triton; print('== Triton', triton.__version__)"
  for regs in 0 168 255; do
    for shape in "1 512" "8 32768"; do
      set -- $shape
      echo "-- KVWEAVE_DENSE_REGISTERS=$regs (0: the launch's caps), batch $1, tokens $2"
      PYTHONPATH=$path KVWEAVE_DENSE_REGISTERS=$regs python benchmarks/kernel_sass.py --storages k4v2e48t,k4v4e77t \
        --configs dense: --batch $1 --tokens $2 2>&1 | grep -E "^\|"
    done
  done
  echo "-- depthweave-kv's tiles pass, batch 1, tokens 2048"
  PYTHONPATH=$path python benchmarks/kernel_sass.py --method depthweave-kv --tokens 2048 2>&1 | grep -E "^\| dep"
done
