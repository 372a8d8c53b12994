"""4-bit uniform values in tiles: the offset taken off at the end (LEVELS 3) against the paired add per register."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import attrs, torch
from decode_kernel import device_us
from lowbit_kernel import packed_view, Q_HEADS, HEAD_DIM
from kvweave.kernels import lowbit_dense as ld
from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode
out = os.environ.get("OUT", ".")
scale = HEAD_DIM ** -0.5
res = []
for tokens, batch in [(65536, 8), (65536, 64), (32768, 1)]:
    view = attrs.evolve(packed_view(batch, tokens, storage="k4v4e77t"), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    twin = torch_lowbit_decode(view, q.float(), None, scale) if batch <= 8 else None
    for rnd in range(2):
        for flag in (False, True):
            ld.DENSE_OFFSET_OUT = flag
            call = lambda: lowbit_decode(view, q, None, scale, variant="dense", programs=None)
            diff = float((call() - twin).abs().max()) if twin is not None else float("nan")
            us = min(device_us(call, 20) for _ in range(3))
            row = dict(offset_out=flag, rnd=rnd, tokens=tokens, batch=batch, us=round(us, 2), diff=diff)
            res.append(row)
            print(json.dumps(row), flush=True)
    del view
    torch.cuda.empty_cache()
with open(f"{out}/ab4-k4v4e77t.jsonl", "a") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
