"""``streaming-llm``: attention sinks plus the recent window; every other token is evicted.

Xiao, Tian, Chen, Han, Lewis: "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
arXiv:2309.17453). The first ``sinks`` tokens of each sequence (its real tokens: left padding does not
count) are kept; the recent window is the pipeline's exact window (``recent_window``); a token leaving
the window is dropped, its bytes freed. With ``block_tokens = 1`` exactly ``sinks + recent_window``
tokens are held after every step.
"""

from __future__ import annotations

import attrs
import torch

from kvweave.core import hookimpl
from kvweave.core.interfaces import DROPPED, RouteBlock, Router
from kvweave.core.params import integer


@attrs.frozen
class StreamingLLMRouter(Router):
    """Keep the first ``sinks`` real tokens and the exact recent window; drop the rest."""

    sinks: int = attrs.field(default=4, validator=integer(0, 1 << 20), metadata={"doc": "first tokens kept as attention sinks"})

    def levels(self) -> tuple[int, ...]:
        return (DROPPED, 0)

    def assign(self, block: RouteBlock) -> torch.Tensor:
        if block.positions is None or block.valid is None:
            raise ValueError("router 'streaming-llm' needs token positions (the cache passes them when it evicts)")
        keep = block.valid & (block.positions < self.sinks)
        return torch.where(keep, 0, DROPPED).long()


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("streaming-llm", StreamingLLMRouter)
