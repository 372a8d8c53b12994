"""A/B of dense-kernel builds: device time per call at several sizes, per-kernel split at small batch."""
import json, os, sys, time
sys.path.insert(0, "benchmarks")
import attrs, torch
from decode_kernel import device_us
from lowbit_kernel import packed_view, view_bytes, Q_HEADS, HEAD_DIM, KV_HEADS, WINDOW
from kvweave.kernels import lowbit_dense as ld
from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode

label, storage = sys.argv[1], sys.argv[2]
variants = sys.argv[3].split(",")  # chains:registers
sizes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[4].split(",")]  # TOKENSxBATCH
out = os.environ.get("OUT", ".")
scale = HEAD_DIM ** -0.5
res = []
torch.manual_seed(0)
for tokens, batch in sizes:
    view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for var in variants:
        ch, reg = (int(x) for x in var.split(":"))
        if hasattr(ld, "DENSE_KEY_CHAINS"):
            ld.DENSE_KEY_CHAINS = ch
        ld.DENSE_MAX_REGISTERS = reg
        call = lambda: lowbit_decode(view, q, None, scale, variant="dense", programs=None)
        if tokens == 32768 and batch == 1:
            twin = torch_lowbit_decode(view, q.float(), None, scale)
            diff = float((call() - twin).abs().max())
        else:
            diff = float("nan")
        us = [device_us(call, 20) for _ in range(3)]
        row = dict(label=label, storage=storage, var=var, tokens=tokens, batch=batch, us=min(us), all=us, diff=diff, bytes=view_bytes(view))
        if batch <= 8:
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            row["kernels"] = {e.key[:40]: round((getattr(e, "self_device_time_total", 0) or 0) / 20, 2) for e in prof.key_averages()}
        res.append(row)
        print(json.dumps(row), flush=True)
    del view
    torch.cuda.empty_cache()
with open(f"{out}/ab-{label}-{storage}.jsonl", "a") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
