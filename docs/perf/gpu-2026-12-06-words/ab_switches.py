"""The ``tiles`` pass under settings of :mod:`kvweave.kernels.depthweave_decode`'s switches, each in turn, twice, per
shape, on ``decode_kernel.py``'s storage (``depthweave-kv``, Llama-3-8B attention shape: 4 query heads a KV head):
device time (the best of three timings of 20 calls), graph time (20 calls replayed from a CUDA graph), SDPA's over a
full bfloat16 cache beside them, the largest difference from the first setting's output and from the float32 twin.

    python docs/perf/gpu-2026-12-06-words/ab_switches.py TxB,TxB,... SETTING [SETTING ...]

A SETTING is ``NAME=VALUE`` pairs joined by ``+`` (``-`` for the module's defaults), e.g.
``- TILES_PAIRS=1 TILES_WORDS=2``; every setting starts from the defaults."""
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from decode_kernel import HEAD_DIM, KV_HEADS, Q_HEADS, device_us, first_rows, graph_us, llama3_window_config  # noqa: E402

from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine.cache import KVWeaveCache  # noqa: E402
from kvweave.engine.synthetic import fill_cache  # noqa: E402
from kvweave.kernels import depthweave_decode as dd  # noqa: E402
from kvweave.kernels.decode_torch import torch_decode  # noqa: E402

DEFAULTS = {name: getattr(dd, name) for name in dir(dd) if name.startswith("TILES_")}


def parse(setting: str) -> dict:
    """``NAME=VALUE+...`` as the switches it sets (an unknown name is refused by name)."""
    out = {}
    for pair in ([] if setting == "-" else setting.split("+")):
        name, value = pair.split("=")
        if name not in DEFAULTS:
            raise SystemExit(f"{name} is not a switch of depthweave_decode ({', '.join(sorted(DEFAULTS))})")
        out[name] = int(value) if DEFAULTS[name] is None else type(DEFAULTS[name])(int(value))
    return out


def sdpa_us(tokens: int, batch: int) -> tuple[float, float]:
    k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    return min(device_us(call, 20) for _ in range(3)), graph_us(call, 5)


shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
settings = [(s, parse(s)) for s in sys.argv[2:] or ["-"]]
scale = HEAD_DIM ** -0.5
by_tokens: dict[int, list[int]] = {}
for tokens, batch in shapes:
    by_tokens.setdefault(tokens, []).append(batch)
print("| T | B | round | setting | device (us) | graph (us) | SDPA device / graph (us) | max abs diff vs the first | vs twin |")
print("|---:|---:|---:|---|---:|---:|---:|---:|---:|")
for tokens, batches in by_tokens.items():
    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, max(batches), tokens, chunk=8192, device="cuda", seed=tokens)
    full = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
    for batch in batches:
        view = full if batch == max(batches) else first_rows(full, batch)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        twin = torch_decode(view, q, None, scale).float()
        sdpa = sdpa_us(tokens, batch)
        for rnd in range(2):
            base = None
            for name, switches in settings:
                for switch, value in {**DEFAULTS, **switches}.items():
                    setattr(dd, switch, value)
                call = lambda: dd.fused_decode(view, q, None, scale, variant="tiles")  # noqa: E731
                out = call().float()
                base = out if base is None else base
                us = min(device_us(call, 20) for _ in range(3))
                g = graph_us(call, 5)
                print(f"| {tokens} | {batch} | {rnd} | {name} | {us:.1f} | {g:.1f} | {sdpa[0]:.1f} / {sdpa[1]:.1f} "
                      f"| {float((out - base).abs().max()):.1e} | {float((out - twin).abs().max()):.2e} |", flush=True)
    del cache, full
    torch.cuda.empty_cache()
