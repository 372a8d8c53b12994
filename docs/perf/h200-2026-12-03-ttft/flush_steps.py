import sys, time, torch
sys.path.insert(0, "benchmarks")
import decode_e2e as D
D.REGISTRY = "benchmarks/dense_sweep.toml"
B = int(sys.argv[1]) if len(sys.argv) > 1 else 130
model = D.random_model(D.llama3_8b(), "cuda")
cache = D.make_cache("kzd-k4v2-f48-d128", model, B, 65536, "cuda")
eng = cache.engine
timers = {}
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter(); r = f(*a, **k); torch.cuda.synchronize()
        timers.setdefault(label, []).append(time.perf_counter() - t); return r
    object.__setattr__(obj, name, g)
wrap(eng, "_flush", "engine._flush")
wrap(eng.kernel, "_packed_view", "kernel._packed_view")
wrap(eng.kernel, "_restored", "kernel._restored")
import kvweave.plugins.kernels.lowbit as LB
f0 = LB.hidden_prefix
def hp(*a, **k):
    torch.cuda.synchronize(); t = time.perf_counter(); r = f0(*a, **k); torch.cuda.synchronize()
    timers.setdefault("hidden_prefix", []).append(time.perf_counter() - t); return r
LB.hidden_prefix = hp
if hasattr(eng, "storage_changed"):
    pass
clock = D.StepClock()
t0 = time.perf_counter()
D.generate_steps(model, cache, B, 65536, 72, "cuda", clock)
st = [t0] + clock.times
steps = [b - a for a, b in zip(st, st[1:])]
order = sorted(range(len(steps)), key=lambda i: -steps[i])[:6]
print("median step ms", sorted(steps)[len(steps) // 2] * 1e3)
print("slowest steps (1-based):", [(i + 1, round(steps[i] * 1e3, 1)) for i in order])
for k, v in timers.items():
    print(f"{k}: {len(v)} calls, {sum(v):.3f} s total, max {max(v)*1e3:.1f} ms")
