#!/bin/bash
# The tiles pass's int8 coefficients by byte permutes and its value coefficients loaded token-major: the build's counts
# on the GPU machine's Triton, the GPU tests, and each setting in turn on depthweave-kv's storage. Output under $OUT.
#   OUT=... PART=a bash docs/perf/gpu-2026-12-06-bytes/lease.sh
OUT=${OUT:-out}; PART=${PART:-a}; mkdir -p "$OUT"
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu-$PART.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu-$PART.txt"
git log -1 --format='tree of %h %s' | tee -a "$OUT/gpu-$PART.txt"
D=docs/perf/gpu-2026-12-06-bytes
if [ "$PART" = a ]; then
  python $D/sass_bytes.py 2>&1 | grep -v -i warn | tee "$OUT/run1-sass.txt"
  python -m pytest -q tests/test_tiles_bytes.py tests/test_tiles_pass.py tests/test_kernels.py 2>&1 | tail -6 | tee "$OUT/run1-tests.txt"
  python $D/ab_bytes.py 32768x1,32768x8,131072x1,131072x8 2>&1 | tee "$OUT/run1-ab.md"
fi
if [ "$PART" = b ]; then
  [ -n "$NCU_ONLY" ] || for args in "--tokens 32768 --batch 1 --warps 1,2 --splits 0,128,512,1024" "--tokens 131072 --batch 1 --warps 1,2 --splits 0,512,2048" \
              "--tokens 131072 --batch 8 --warps 1,2 --splits 0,1024,4096"; do
    python benchmarks/kernel_tuning.py $args --blocks 64 --stages 1 2>&1 | grep -v -i warn
  done | tee "$OUT/run2-tuning.txt"
  N=${N:-2}
  which ncu && for shape in "131072 8" "32768 1"; do
    set -- $shape
    ncu --nvtx --nvtx-include decode/ --kernel-name regex:^_tiles_kernel --launch-skip 2 --launch-count 1 --set full --import-source yes -o "$OUT/tiles-$1-$2" \
      python $D/calls.py $1 $2 >/dev/null 2>&1
    ncu -i "$OUT/tiles-$1-$2.ncu-rep" --page details > "$OUT/run$N-ncu-$1-$2-details.txt"
    ncu -i "$OUT/tiles-$1-$2.ncu-rep" --page source --csv --print-source sass > "$OUT/src.csv"
    python docs/perf/h200-2026-12-03-planes/ncu_summary.py "$OUT/src.csv" > "$OUT/run$N-ncu-$1-$2-summary.txt"
    rm -f "$OUT/src.csv" "$OUT/tiles-$1-$2.ncu-rep"
  done
fi
if [ "$PART" = c ]; then
  python -m pytest -q tests/test_tiles_bytes.py tests/test_tiles_pass.py 2>&1 | tail -3 | tee "$OUT/run4-tests.txt"
  python $D/ab_bytes.py 32768x1,32768x8,131072x1,131072x8 000,110,111 2>&1 | grep -v -i warn | tee "$OUT/run4-ab.md"
fi
if [ "$PART" = d ]; then
  python -m pytest -q tests/test_tiles_bytes.py tests/test_graphs_gpu.py -k "bytes or permutes or depthweave" 2>&1 | tail -3 | tee "$OUT/run5-tests.txt"
  python $D/ab_bytes.py 32768x1,131072x8 000,110 2>&1 | grep -v -i warn | tee "$OUT/run5-ab.md"
  python benchmarks/decode_kernel.py --tokens 32768,131072 --batches 1,8,32 --variants tiles --reps 20 --out "$OUT" 2>&1 \
    | grep -v -i warn | tail -20 | tee "$OUT/run5-decode_kernel.txt"
fi
if [ "$PART" = e ]; then  # also the GPU test of the dense kernel's rule with 4-bit values, not run since the rule took them
  python -m pytest -q tests/test_tiles_bytes.py tests/test_dense_ahead.py 2>&1 | tail -3 | tee "$OUT/run6-tests.txt"
  python $D/ab_bytes.py 32768x1,32768x8,131072x1,131072x8 1100,1101,1102 2>&1 | grep -v -i warn | tee "$OUT/run6-ab.md"
  python benchmarks/kernel_tuning.py --tokens 131072 --batch 8 --warps 1 --splits 0 --blocks 64 --stages 1,2,3 2>&1 \
    | grep -v -i warn | tee "$OUT/run6-stages.txt"
fi
if [ "$PART" = f ]; then  # part e, trimmed to the device time left
  python -m pytest -q tests/test_tiles_bytes.py -k "gpu and not build" 2>&1 | tail -2 | tee "$OUT/run6-tests.txt"
  python $D/ab_bytes.py 32768x1,131072x8 1100,1101,1102 2>&1 | grep -v -i warn | tee "$OUT/run6-ab.md"
fi
