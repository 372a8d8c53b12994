"""``streaming-llm``: attention sinks plus the recent window; every other token is evicted.

Xiao, Tian, Chen, Han, Lewis: "Efficient Streaming Language Models with Attention Sinks" (ICLR 2024,
arXiv:2309.17453). The first ``sinks`` tokens of each sequence (its real tokens: left padding does not
count) are kept; the recent window is the pipeline's exact window (``recent_window``); a token leaving
the window is dropped, its bytes freed. With ``block_tokens = 1`` exactly ``sinks + recent_window``
tokens are held after every step.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.lazy import torch
from kvweave.core.params import integer


@attrs.frozen
class StreamingLLMEvictor(Evictor):
    """Keep the first ``sinks`` real tokens and the exact recent window; drop the rest."""

    head_sharding: ClassVar[str] = "head-local"

    sinks: int = attrs.field(default=4, validator=integer(0, 1 << 20), metadata={"doc": "first tokens kept as attention sinks"})

    def keep(self, block: EvictionBlock) -> torch.Tensor:
        return block.valid & (block.positions < self.sinks)


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("streaming-llm", StreamingLLMEvictor)
