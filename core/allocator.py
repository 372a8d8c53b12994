"""The CUDA caching allocator setting kvweave's entry points prefer: expandable segments.

A compressed cache grows by concatenating each newly compressed block to its store: one new tensor per layer as large
as the layer's store (3.6 GB a layer for 130 rows of 64K tokens on Llama-3-8B's shape), allocated while the old one is
alive. With the GPU nearly full, PyTorch's default allocator then frees its cached blocks and maps new ones, a
synchronizing round trip, inside the step that flushes: on an H200 at B = 130 that step took 1.63 s against a 156 ms
median; with expandable segments (one mapping grown and shrunk in place) 0.63 s, and the mean step 177 -> 163 ms
(docs/kernels.md, "Value codes as operand pairs").

:func:`prefer_expandable_segments` sets it where the user set no allocator configuration and CUDA has not started in
this process (the allocator reads it once, when it starts), outside torchrun's multi-rank runs (not measured with NCCL);
``kvweave`` commands and the decode benchmarks call it first.
"""

from __future__ import annotations

import os
import sys

#: the variables PyTorch reads its allocator configuration from (the first is the newer, general name)
ALLOC_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
PREFERRED = "expandable_segments:True"


def prefer_expandable_segments() -> bool:
    """Ask for expandable segments unless the user configured the allocator or CUDA has already started; returns
    whether it did."""
    if any(os.environ.get(name) for name in ALLOC_VARIABLES):
        return False
    world = os.environ.get("WORLD_SIZE", "")
    if world.isdigit() and int(world) > 1:  # torchrun's ranks (--tp): not measured with NCCL, left as they are
        return False
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return False
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = PREFERRED
    return True
