"""The query energy of each key channel, for quantizers that spend bits where the queries look.

A key channel's quantization error enters the attention logit multiplied by the query's value in that
channel, so the logit error a channel causes grows with the energy the model's queries put on it. The
cache accumulates, per layer, batch row and KV head, the sum of each query channel's square over every
query the layer has attended with (the query heads of a KV head summed), and hands the mean to a quantizer
that declares ``uses_query_energy`` (``channel-alloc`` with ``query_weight > 0``) when a key block is
packed. The context's own queries are what is seen: no question is needed. Channels ``c`` and ``c + D/2``
turn together under Llama-style RoPE, so their summed energy is the same before and after the rotation
(what a quantizer tying those pairs reads). Stored: float32 [B, H, D] per layer, counted in the cache's
bytes (part ``observation``).
"""

from __future__ import annotations

import torch

from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, Quantizer
from kvweave.core.registry import ResolvedPipeline
from kvweave.core.storage import tensor_bytes


def weighs_by_energy(pipeline: ResolvedPipeline, basis: BasisBuilder, quantizers: list[dict[str, Quantizer]], where: str) -> bool:
    """Whether a keys quantizer weighs its channels by the queries' energy; refused for values (a key
    channel's error is what the query multiplies) and for a basis whose coefficients are not the channels."""
    if any(getattr(q["values"], "uses_query_energy", False) for q in quantizers):
        raise ModelError(
            f"{where}, slot '{pipeline.slot_for('quantizer', 'values')}': weighing channels by the queries' "
            "energy applies to keys (a key channel's error is multiplied by the query's); set query_weight = 0 for values"
        )
    wants = any(getattr(q["keys"], "uses_query_energy", False) for q in quantizers)
    if wants and not basis.keeps_channels:
        raise ModelError(
            f"{where}, slot '{pipeline.slot_for('quantizer', 'keys')}': weighing channels by the queries' energy "
            f"needs coefficients that are the keys' own channels, which basis '{pipeline.use('basis')}' does not "
            "keep; use basis 'identity' or query_weight = 0"
        )
    return wants


class QueryEnergy:
    """Running per-channel query energy of every layer."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        self._sums: list[torch.Tensor | None] = [None] * self.num_layers
        self._counts = [0] * self.num_layers

    def record(self, layer: int, query: torch.Tensor, kv_heads: int) -> None:
        """Add the queries [B, Hq, q, D] of one forward of ``layer`` (``kv_heads`` KV heads, Hq a multiple)."""
        batch, heads, tokens, width = query.shape
        if heads % kv_heads:
            raise CacheStateError(f"layer {layer}: {heads} query heads do not share {kv_heads} KV heads evenly")
        energy = query.detach().float().square().sum(dim=-2).reshape(batch, kv_heads, heads // kv_heads, width).sum(dim=2)
        old = self._sums[layer]
        self._sums[layer] = energy if old is None else old + energy
        self._counts[layer] += tokens

    def means(self, layers: tuple[int, ...]) -> torch.Tensor:
        """The mean energy per channel [G, B, H, D] of ``layers`` (every one must have recorded queries)."""
        missing = [layer for layer in layers if self._sums[layer] is None]
        if missing:
            raise CacheStateError(
                f"layers {missing} have no recorded queries, which the keys' quantizer weighs its channels by; "
                "build the cache with build_cache(pipeline, model) so the model's attention reports to it"
            )
        return torch.stack([self._sums[layer] / self._counts[layer] for layer in layers])  # type: ignore[operator]

    def nbytes(self) -> int:
        return tensor_bytes([s for s in self._sums if s is not None])

    def select_batch(self, index: torch.Tensor) -> None:
        self._sums = [None if s is None else s.index_select(0, index.to(s.device)) for s in self._sums]
