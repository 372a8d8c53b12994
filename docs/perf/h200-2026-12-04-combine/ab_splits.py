"""Splits at small batch with the loop-free combine: DENSE_SPLIT_STEPS / DENSE_MAX_SPLITS / COMBINE_WHOLE_SPLITS."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import attrs, torch
from decode_kernel import device_us
from lowbit_kernel import packed_view, Q_HEADS, HEAD_DIM
from kvweave.kernels import lowbit_combine as lc, lowbit_dense as ld
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch
from torch.profiler import ProfilerActivity, profile

storage = sys.argv[1]
sizes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[2].split(",")]
variants = [tuple(int(x) for x in v.split(":")) for v in sys.argv[3].split(",")]  # steps:maxsplits:whole
out = os.environ.get("OUT", ".")
scale = HEAD_DIM ** -0.5
res = []
for tokens, batch in sizes:
    view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    for rnd in range(2):
        for steps, most, whole in variants:
            ld.DENSE_SPLIT_STEPS, ld.DENSE_MAX_SPLITS, lc.COMBINE_WHOLE_SPLITS = steps, most, whole
            splits = plan_launch(view, q, None, scale, variant="dense", programs=None).grid[1]
            call = lambda: lowbit_decode(view, q, None, scale, variant="dense", programs=None)
            us = min(device_us(call, 20) for _ in range(3))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            ks = {e.key[:32]: round((getattr(e, "self_device_time_total", 0) or 0) / 20, 2) for e in prof.key_averages() if "lowbit" in e.key}
            row = dict(storage=storage, var=f"{steps}:{most}:{whole}", splits=splits, rnd=rnd, tokens=tokens, batch=batch, us=round(us, 2), kernels=ks)
            res.append(row)
            print(json.dumps(row), flush=True)
    del view
    torch.cuda.empty_cache()
with open(f"{out}/ab3-{storage}.jsonl", "a") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
