#!/bin/bash
# The combine launched early (a programmatic dependent of the dense kernel's pass) past one wave too: the launch's
# EARLY_COMBINE_WAVES (kvweave.kernels.lowbit_dense) at 99 against 1 (the default), set in the benchmark's process,
# each in turn: benchmarks/lowbit_kernel.py --cold-l2 at B = 8 and 32, 32K and 64K, kzd-k4vq25-f40's two kinds of
# layer (weighed by benchmarks/layer_mix.py) and k4v2e48t.
# OUT=/tmp/o timeout 500 bash docs/perf/gpu-2026-12-07-fused/lease_pdl.sh (run 1); run 2: WAVES="99 1"
# STORAGES="k4v2e48t k4v4e77t" TOKENS=32768,65536,131072 (the mix step then finds no runs)
source benchmarks/lease_preamble.sh
bench() {  # storage, waves
  step 100 $1-w$2.md python -c "import sys, runpy; import kvweave.kernels.lowbit_dense as d; d.EARLY_COMBINE_WAVES = $2; sys.path.insert(0, 'benchmarks')
sys.argv = ['lowbit_kernel.py', '--reps', '10', '--tokens', '${TOKENS:-32768,65536}', '--batches', '8,32', '--storage', '$1',
            '--post-rope', '--configs', 'dense:64:4:0', '--cold-l2', '--out', '$OUT/$1-w$2']
runpy.run_path('benchmarks/lowbit_kernel.py', run_name='__main__')"
  rm -f "$OUT/$1-w$2"/*.png
}
for waves in ${WAVES:-1 99}; do
  for storage in ${STORAGES:-k4v2e40t k4v4e40t k4v2e48t}; do bench $storage $waves; done
  step 30 mix-w$waves.md python benchmarks/layer_mix.py "$OUT/k4v2e40t-w$waves/lowbit_kernel.json:22" \
    "$OUT/k4v4e40t-w$waves/lowbit_kernel.json:8"
done
