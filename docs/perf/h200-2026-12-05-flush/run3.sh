#!/bin/bash
# Run 3 (tree of the group-at-once flush): GPU tests, time to first token, the prompt's compression split, decode steps with flushes.
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python -m pytest -q tests/test_flush_passes.py tests/test_graphs.py -k "flush or depthweave or gpu" 2>&1 | tail -3 > $OUT/run3-tests.txt
python benchmarks/decode_e2e.py --methods depthweave-kv,full --batches "" --ttft 32768 --out $OUT/run3-ttft 2>&1 | grep -v -i warn | tail -8 > $OUT/run3-ttft.txt
python benchmarks/profile_prefill.py --tokens 32768 --ops 40 2>&1 | grep -v -i warn > $OUT/run3-prefill.txt
python benchmarks/decode_e2e.py --methods depthweave-kv@graphs --batches 1,8 --steps 72 --out $OUT/run3-e2e 2>&1 | grep -v -i warn | tail -8 > $OUT/run3-e2e.txt
python benchmarks/profile_decode.py --method depthweave-kv --batch 1 --steps 33 --warmup 3 --top 25 2>&1 | grep -v -i warn > $OUT/run3-flush-profile.txt
