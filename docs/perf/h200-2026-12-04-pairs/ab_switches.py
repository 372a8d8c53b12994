"""The ``tiles`` pass's two switches (``kvweave.kernels.depthweave_decode.TILES_COLUMNS``: the residual words read as a
column in the residual tile's layout; ``TILES_AHEAD``: each step's words loaded during the step before), each setting
in turn, twice, per shape, on ``decode_kernel.py``'s storage, with the largest difference from the torch twin.

    python docs/perf/h200-2026-12-04-pairs/ab_switches.py TxB,TxB,...   (e.g. 32768x1,131072x8,131072x32)

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
            for columns, ahead in ((False, False), (True, False), (False, True), (True, True)):
                dd.TILES_COLUMNS, dd.TILES_AHEAD = columns, ahead
                call = lambda: dd.fused_decode(view, q, None, scale, variant="tiles")  # noqa: E731
                diff = float((call().float() - twin).abs().max())
                us = min(device_us(call, 20) for _ in range(3))
                print(f"T={tokens} B={batch} round {rnd} columns={columns} ahead={ahead}: {us:.1f} us, "
                      f"max |diff| vs twin {diff:.2e}", flush=True)
    del cache, full
    torch.cuda.empty_cache()
