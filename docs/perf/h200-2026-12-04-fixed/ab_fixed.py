"""A switch of kvweave.kernels.lowbit_dense off and on, in turn, twice, per storage and shape, with the largest
difference from the torch twin at B <= 8: by default DENSE_FIXED_MAX (the softmax against a fixed reference, what the
launch now takes, against a running maximum, the build before), or the switch named third (DENSE_WHOLE_WAVES), or the
numbers given for a setting (DENSE_MAX_REGISTERS=96,80).

    python docs/perf/h200-2026-12-04-fixed/ab_fixed.py STORAGE TxB,TxB,... [SWITCH | NAME=a,b]

Writes OUT/ab-STORAGE.jsonl (OUT: the environment's, else the working folder)."""
import json
import os
import sys

sys.path.insert(0, "benchmarks")
import attrs  # noqa: E402
import torch  # noqa: E402
from decode_kernel import device_us  # noqa: E402
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

from kvweave.kernels import lowbit_dense as ld  # noqa: E402
from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode  # noqa: E402

storage, shapes = sys.argv[1], [tuple(int(x) for x in s.split("x")) for s in sys.argv[2].split(",")]
switch = sys.argv[3] if len(sys.argv) > 3 else "DENSE_FIXED_MAX"
settings = (False, True)
if "=" in switch:  # NAME=a,b: numbers in turn instead of off and on
    switch, values = switch.split("=")
    settings = tuple(int(v) for v in values.split(","))
out = os.environ.get("OUT", ".")
scale = HEAD_DIM ** -0.5
sms = torch.cuda.get_device_properties(0).multi_processor_count
for tokens, batch in shapes:
    view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    twin = torch_lowbit_decode(view, q.float(), None, scale) if batch <= 8 else None
    for rnd in range(2):
        for fixed in settings:
            setattr(ld, switch, fixed)
            call = lambda: lowbit_decode(view, q, None, scale, variant="dense", programs=None)  # noqa: E731
            diff = float((call() - twin).abs().max()) if twin is not None else float("nan")
            us = min(device_us(call, 20) for _ in range(3))
            splits = ld.dense_splits(batch * 8, view.tokens // 64, sms, HEAD_DIM, False)
            registers = ld.dense_registers(HEAD_DIM, False)
            row = dict(storage=storage, switch=switch, on=fixed, splits=splits, registers=registers, rnd=rnd,
                       tokens=tokens, batch=batch, us=round(us, 2), diff=diff)
            print(json.dumps(row), flush=True)
            with open(f"{out}/ab-{storage}.jsonl", "a") as handle:
                handle.write(json.dumps(row) + "\n")
    del view, twin
    torch.cuda.empty_cache()
