"""The flush's attention statistics (``fused_packed_logsumexp``: every observed query of each head over the packed
tokens) by the ``tiles`` and the ``gather`` pass, against the torch twin, on ``decode_kernel.py``'s storage.

    python docs/perf/h200-2026-12-04-pairs/lse_variants.py [TOKENS,...] [BATCH,...] [OBSERVED]

Defaults: 32768,65536 tokens, batches 1,8, 8 observed queries a head (``depthweave-kv``'s ``observe_queries``), so 32
query columns a KV head at the Llama-3-8B shape. Prints one line a (T, B, pass): device time of one layer's call."""
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from decode_kernel import HEAD_DIM, Q_HEADS, device_us, first_rows, llama3_window_config  # noqa: E402

from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine.cache import KVWeaveCache  # noqa: E402
from kvweave.engine.synthetic import fill_cache  # noqa: E402
from kvweave.kernels.decode_torch import torch_packed_logsumexp  # noqa: E402
from kvweave.kernels.depthweave_decode import fused_packed_logsumexp  # noqa: E402

tokens_list = [int(t) for t in (sys.argv[1] if len(sys.argv) > 1 else "32768,65536").split(",")]
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
observed = int(sys.argv[3]) if len(sys.argv) > 3 else 8
scale = HEAD_DIM ** -0.5
for tokens in tokens_list:
    cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
    fill_cache(cache, max(batches), tokens, chunk=8192, device="cuda", seed=tokens)
    full = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
    for batch in batches:
        view = full if batch == max(batches) else first_rows(full, batch)
        q = torch.randn(batch, Q_HEADS * observed, HEAD_DIM, device="cuda").to(torch.bfloat16)
        twin = torch_packed_logsumexp(view, q, scale)
        for variant in ("tiles", "gather"):
            call = lambda: fused_packed_logsumexp(view, q, scale, variant=variant)  # noqa: E731
            diff = float((call() - twin).abs().max())
            print(f"T={tokens} B={batch} observed={observed} {variant}: {device_us(call, 20):.1f} us, "
                  f"max |diff| vs twin {diff:.2e}", flush=True)
    del cache, full
    torch.cuda.empty_cache()
