"""The combine with and without loops: device time per call and per kernel."""
import json, os, sys
sys.path.insert(0, "benchmarks")
import attrs, torch
from decode_kernel import device_us
from lowbit_kernel import packed_view, view_bytes, Q_HEADS, HEAD_DIM
from kvweave.kernels import lowbit_combine as lc
from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode
from torch.profiler import ProfilerActivity, profile

storage = sys.argv[1]
sizes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[2].split(",")]
out = os.environ.get("OUT", ".")
scale = HEAD_DIM ** -0.5
orig = lc.plan_combine
def variant(name):
    lc.COMBINE_WHOLE_SPLITS = 0 if name == "loop" else 64
    warps = {"whole8": 8, "whole4": 4, "loop": None}[name]
    def planned(*a, **k):
        launch = orig(*a, **k)
        if warps is not None and launch.constants.get("WHOLE"):
            launch = attrs.evolve(launch, constants={**launch.constants, "num_warps": warps})
        return launch
    import kvweave.kernels.lowbit_decode as d
    d.plan_combine = planned
res = []
for tokens, batch in sizes:
    view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    twin = torch_lowbit_decode(view, q.float(), None, scale) if batch <= 8 else None
    for rnd in range(2):
        for name in ("loop", "whole8", "whole4"):
            variant(name)
            call = lambda: lowbit_decode(view, q, None, scale, variant="dense", programs=None)
            diff = float((call() - twin).abs().max()) if twin is not None else float("nan")
            us = min(device_us(call, 20) for _ in range(3))
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    call()
                torch.cuda.synchronize()
            ks = {e.key[:32]: round((getattr(e, "self_device_time_total", 0) or 0) / 20, 2) for e in prof.key_averages() if "lowbit" in e.key}
            row = dict(storage=storage, var=name, rnd=rnd, tokens=tokens, batch=batch, us=round(us, 2), diff=diff, kernels=ks, bytes=view_bytes(view))
            res.append(row)
            print(json.dumps(row), flush=True)
    del view
    torch.cuda.empty_cache()
with open(f"{out}/ab2-{storage}.jsonl", "a") as f:
    for r in res:
        f.write(json.dumps(r) + "\n")
