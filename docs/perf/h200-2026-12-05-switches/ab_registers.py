"""The ``tiles`` pass with its registers a thread bounded (``kvweave.kernels.depthweave_decode.TILES_MAX_REGISTERS``:
None, the compiler's choice, or a bound such as 128) and both switches on, each setting in turn, twice, per shape,
on ``decode_kernel.py``'s storage, with the largest difference from the torch twin.

    python docs/perf/h200-2026-12-05-switches/ab_registers.py TxB,TxB,... [BOUND,...]   (e.g. 32768x1,131072x8 128,112)

Prints one line a (shape, round, setting): the best of three timings of 20 calls (device time, us)."""
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from decode_kernel import HEAD_DIM, Q_HEADS, device_us, first_rows, llama3_window_config  # noqa: E402

from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine.cache import KVWeaveCache  # noqa: E402
from kvweave.engine.synthetic import fill_cache  # noqa: E402
from kvweave.kernels import depthweave_decode as dd  # noqa: E402
from kvweave.kernels.decode_torch import torch_decode  # noqa: E402

shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
bounds = [None] + [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "128").split(",")]
scale = HEAD_DIM ** -0.5
by_tokens: dict[int, list[int]] = {}
for tokens, batch in shapes:
    by_tokens.setdefault(tokens, []).append(batch)
for tokens, batches in by_tokens.items():
    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, max(batches), tokens, chunk=8192, device="cuda", seed=tokens)
    full = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
    for batch in batches:
        view = full if batch == max(batches) else first_rows(full, batch)
        q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
        twin = torch_decode(view, q, None, scale).float()
        for rnd in range(2):
            for bound in bounds:
                dd.TILES_MAX_REGISTERS = bound
                call = lambda: dd.fused_decode(view, q, None, scale, variant="tiles")  # noqa: E731
                diff = float((call().float() - twin).abs().max())
                us = min(device_us(call, 20) for _ in range(3))
                print(f"T={tokens} B={batch} round {rnd} registers={bound}: {us:.1f} us, "
                      f"max |diff| vs twin {diff:.2e}", flush=True)
    del cache, full
    torch.cuda.empty_cache()
