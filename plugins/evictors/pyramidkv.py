"""``pyramidkv``: SnapKV-style selection under layer budgets that shrink linearly with depth.

Cai, Zhang, Gao, Liu, Liu, Lu, Xiong, Dong, Chang, Hu, Xiao: "PyramidKV: Dynamic KV Cache Compression
based on Pyramidal Information Funneling" (arXiv:2406.02069). Lower layers attend broadly and get more
tokens, upper layers fewer: the budget per layer falls linearly from the first layer to the last, with
the mean over layers equal to the pipeline's budget (``budget`` tokens or ``fraction`` of the tokens).
Only the part beyond the exact recent window is shaped: the last layer keeps
``window + (mean - window) / beta`` tokens and the first ``2 * mean - that``. Within a layer, tokens are
chosen as in ``snapkv`` (pooled observation-window votes, per KV head, at prefill).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.evictor import EvictionBlock
from kvweave.core.interfaces import ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import number

from ._budget import totals
from .snapkv import SnapKVEvictor


@attrs.frozen
class PyramidKVEvictor(SnapKVEvictor):
    """SnapKV selection with a linear pyramid of layer budgets (mean = the budget)."""

    head_sharding: ClassVar[str] = "head-local"

    beta: float = attrs.field(default=20.0, validator=number(1.0, 1e6), metadata={"doc": "first-to-last layer ratio of the budget beyond the window"})
    _layers: list = attrs.field(init=False, factory=list, repr=False, eq=False)

    def name(self) -> str:
        return "pyramidkv"

    def check_model(self, shape: ModelShape) -> None:
        self._layers[:] = [shape.num_layers]

    def layer_budgets(self, mean: torch.Tensor, window: int, layers: int) -> torch.Tensor:
        """Budgets [L, B] for means [B] (tokens, window included) over ``layers`` layers."""
        extra = (mean.double() - window).clamp_min(0)
        low = extra / self.beta
        high = 2 * extra - low
        depth = torch.arange(layers, dtype=torch.float64)[:, None] / max(layers - 1, 1)
        return (window + high[None] + (low - high)[None] * depth).round().long()

    def layer_totals(self, block: EvictionBlock) -> torch.Tensor:
        layers = self._layers[0] if self._layers else max(block.layers) + 1
        budgets = self.layer_budgets(totals(block, self.budget, self.fraction), block.window_tokens, layers)
        return budgets[list(block.layers)]


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("pyramidkv", PyramidKVEvictor)
