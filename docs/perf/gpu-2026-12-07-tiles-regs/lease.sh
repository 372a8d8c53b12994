#!/bin/bash
# depthweave-kv's tiles pass with the compiler's registers and capped at 160 (KVWEAVE_TILES_REGISTERS), on the GPU
# machine's Triton 3.6 and on Triton 3.9 (a fresh install's; it builds the pass in 179 registers, 11 one-warp programs an
# SM where the one-wave split rule counts 12). Triton 3.9 travels in two parts (benchmarks/carry_triton.py pack, here):
#   run 1: carry [wheels/triton-3.9.0-1], any command (what a call carried stays while the machine is warm)
#   run 2, within 30 s: carry [wheels/triton-3.9.0-2], command
#          OUT=$OUT timeout 580 bash docs/perf/gpu-2026-12-07-tiles-regs/lease.sh
# Each step's table in $OUT/NAME.md: the GPU test of the cap, then t36-r0, t36-r160, t39-r0, t39-r160, builds.
source benchmarks/lease_preamble.sh
cells="--tokens ${TOKENS:-32768} --batches ${BATCHES:-1,8,32} --reps 20 --cold-l2"
step 60 t36-test.md python -m pytest -q -p no:cacheprovider tests/test_tiles_registers.py
for regs in 0 160; do
  KVWEAVE_TILES_REGISTERS=$regs step ${LIMIT:-100} t36-r$regs.md python benchmarks/decode_kernel.py $cells --out "$OUT/t36-r$regs"
done
step 60 unpack.md python benchmarks/carry_triton.py unpack
source results/triton-3.9.0/env.sh
python -c "import triton; print('then triton', triton.__version__, triton.__file__)" >> "$OUT/gpu.txt"
for regs in 0 160; do
  KVWEAVE_TILES_REGISTERS=$regs step ${LIMIT39:-130} t39-r$regs.md python benchmarks/decode_kernel.py $cells --out "$OUT/t39-r$regs"
done
step 60 t39-test.md python -m pytest -q -p no:cacheprovider tests/test_tiles_registers.py
# the registers, stack and spills of every build the lease timed, both Tritons' (benchmarks/triton_cache_resources.py)
step 90 builds.md python benchmarks/triton_cache_resources.py
