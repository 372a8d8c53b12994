#!/bin/bash
# Run 1: where depthweave-kv's prompt compression goes now; the ~5x class's B = 32 rows.
set -x
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
python -c "import torch, triton; print(torch.__version__, triton.__version__)" >> $OUT/gpu.txt
python benchmarks/profile_prefill.py --tokens 32768 --ops 40 > $OUT/run1-prefill.txt 2>&1
python benchmarks/lowbit_kernel.py --post-rope --reps 10 --configs dense:64:4 --storage k4v4e77t --tokens 32768,65536,131072 --batches 32 > $OUT/run1-k4v4e77t-b32.txt 2>&1
python benchmarks/lowbit_kernel.py --post-rope --reps 10 --configs dense:64:4 --storage k4v2e48t --tokens 65536 --batches 1,8,32 > $OUT/run1-k4v2e48t.txt 2>&1
