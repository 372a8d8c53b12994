#!/bin/bash
# Run 2: the prompt's compression split by the encoder's own steps (the residual functions, the probe, the lists' appends).
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1
python benchmarks/profile_prefill.py --tokens 32768 --ops 60 2>&1 | grep -v -i warn > $OUT/run2-prefill.txt
