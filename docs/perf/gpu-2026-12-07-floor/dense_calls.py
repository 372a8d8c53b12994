"""The dense kernel called a few times on one of ``benchmarks/lowbit_kernel.py``'s storages (keys after RoPE, the
launch's own settings, as ``read_floor.py`` times it), for a profiler to take one call:

    ncu --kernel-name regex:_lowbit_dense_kernel --launch-skip 2 --launch-count 1 --set full --clock-control none \\
        -o dense python docs/perf/gpu-2026-12-07-floor/dense_calls.py k4v2e48t 131072 32
"""
import sys

sys.path.insert(0, "benchmarks")
import attrs  # noqa: E402
import torch  # noqa: E402
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view  # noqa: E402

from kvweave.kernels.lowbit_decode import lowbit_decode  # noqa: E402

storage, tokens, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
for _ in range(5):
    lowbit_decode(view, q, None, HEAD_DIM ** -0.5, 64, 4, "dense", None)
torch.cuda.synchronize()
