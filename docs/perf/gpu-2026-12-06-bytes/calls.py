"""depthweave-kv's fused decode called a few times on ``decode_kernel.py``'s storage of one shape (the launch's own
settings), for a profiler to take one of its passes:

    ncu --nvtx --nvtx-include decode/ --kernel-name regex:^_tiles_kernel --launch-skip 2 --launch-count 1 --set full --import-source yes -o tiles \\
        python docs/perf/gpu-2026-12-06-bytes/calls.py 131072 8
"""
import sys

sys.path.insert(0, "benchmarks")
import torch  # noqa: E402
from decode_kernel import HEAD_DIM, Q_HEADS, llama3_window_config  # noqa: E402

from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine.cache import KVWeaveCache  # noqa: E402
from kvweave.engine.synthetic import fill_cache  # noqa: E402
from kvweave.kernels.depthweave_decode import fused_decode  # noqa: E402

tokens, batch = int(sys.argv[1]), int(sys.argv[2])
cache = KVWeaveCache(load_pipeline("depthweave-kv"), llama3_window_config())
fill_cache(cache, batch, tokens, chunk=8192, device="cuda", seed=tokens)
view = cache.engine.kernel.decode_view(cache.engine.view(1), torch.device("cuda"))
q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda").to(torch.bfloat16)
torch.cuda.synchronize()
torch.cuda.nvtx.range_push("decode")  # the flushes of the fill launch the pass too (without values): not these
for _ in range(5):
    fused_decode(view, q, None, HEAD_DIM ** -0.5, variant="tiles")
torch.cuda.synchronize()
torch.cuda.nvtx.range_pop()
