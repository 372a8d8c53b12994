"""The ``tiles`` pass's int8 coefficients made float16 by byte permutes (``TILES_BYTES``) and its value coefficients
loaded token-major (``TILES_ROWS``), each setting in turn, twice, per shape, on ``decode_kernel.py``'s storage
(``depthweave-kv``, Llama-3-8B attention shape): device time (the best of three timings of 20 calls) and graph time
(20 calls replayed from a CUDA graph), SDPA's over a full bfloat16 cache beside them, and whether each setting writes
the bits of the conversion a code.

    python docs/perf/gpu-2026-12-06-bytes/ab_bytes.py TxB,TxB,... [SETTINGS]   (e.g. 32768x1,131072x8,131072x32)

SETTINGS: comma-separated digits ``bytes rows codes_ahead [words]``, e.g. ``000,100,010,110``; the first is the
reference of "same bits". Run 1 took the default ``000,100,010,110``. ``TILES_CODES_AHEAD`` (each step's coefficient
codes and scales loaded during the step before) existed only in commit a9d4b70, which run 4 timed (``000,110,111``);
the kept kernel has no such switch and the digit sets a module attribute nothing reads. The fourth digit is
``TILES_WORDS`` (0, 1 or 2; 0 when absent)."""
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

SETTINGS = [tuple(c == "1" for c in setting[:3]) + (int(setting[3:] or 0),) for setting in
            (sys.argv[2] if len(sys.argv) > 2 else "000,100,010,110").split(",")]


def sdpa_us(tokens: int, batch: int) -> tuple[float, float]:
    k = torch.randn(batch, KV_HEADS, tokens, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(batch, Q_HEADS, 1, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    call = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
    return min(device_us(call, 20) for _ in range(3)), graph_us(call, 5)


shapes = [tuple(int(x) for x in s.split("x")) for s in sys.argv[1].split(",")]
scale = HEAD_DIM ** -0.5
by_tokens: dict[int, list[int]] = {}
for tokens, batch in shapes:
    by_tokens.setdefault(tokens, []).append(batch)
print("| T | B | round | bytes | rows | codes ahead | words | device (us) | graph (us) | SDPA device / graph (us) | same bits as neither | max abs diff vs twin |")
print("|---:|---:|---:|---|---|---|---:|---:|---:|---:|---|---:|")
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
            for bytes_, rows, ahead, words in SETTINGS:
                dd.TILES_BYTES, dd.TILES_ROWS, dd.TILES_CODES_AHEAD, dd.TILES_WORDS = bytes_, rows, ahead, words
                call = lambda: dd.fused_decode(view, q, None, scale, variant="tiles")  # noqa: E731
                out = call()
                base = out if base is None else base
                same = "yes" if torch.equal(out, base) else f"no ({float((out.float() - base.float()).abs().max()):.1e})"
                diff = float((out.float() - twin).abs().max())
                us = min(device_us(call, 20) for _ in range(3))
                g = graph_us(call, 5)
                print(f"| {tokens} | {batch} | {rnd} | {bytes_} | {rows} | {ahead} | {words} | {us:.1f} | {g:.1f} | {sdpa[0]:.1f} / {sdpa[1]:.1f} "
                      f"| {same} | {diff:.2e} |", flush=True)
    del cache, full
    torch.cuda.empty_cache()
