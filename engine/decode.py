"""Reading a :class:`kvweave.engine.engine.CompressionEngine`'s stored tokens back: a layer's packed tokens
decoded to vectors (coefficients through the basis, residuals added, pre-RoPE keys rotated back at their
cache indices), and the attention the observed queries give a block about to be encoded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.engine.residuals import add_residuals, mix_residuals

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


def reconstruct(engine: CompressionEngine, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The stored (packed) tokens of ``layer`` decoded to [B, H, T_packed, D] in ``dtype``."""
    group_index, member = engine.group_of[layer]
    store = engine.stores[group_index][kind]
    coefficients = engine.quantizer(group_index, kind).dequantize(store.coefficients.fields, dtype)
    vectors = engine.basis.decode(store.state or {}, coefficients, member)
    mixing = engine.basis.residual_mixing(len(engine.groups[group_index])) if engine.residual_levels else None
    windows, router = engine.windows, engine.router
    if mixing is not None:  # residual rows of the whole group (e.g. depth frequencies)
        members = engine.groups[group_index]
        lists = [{rank: r.located_fields() for rank, r in windows[other].residuals[kind].items()} for other in members]
        gates = [router.gates(other, kind) for other in members]
        bases = [windows[other].residual_basis[kind] for other in members]
        vectors = mix_residuals(vectors, member, lists, engine.residual_quantizers[kind], mixing, gates, bases)
    elif engine.residual_levels:
        lists = {rank: r.located_fields() for rank, r in windows[layer].residuals[kind].items()}
        vectors = add_residuals(
            vectors, lists, engine.residual_quantizers[kind], router.gates(layer, kind), windows[layer].residual_basis[kind]
        )
    if engine.pre_rope and kind == "keys":
        window = windows[layer]
        positions = window.positions
        positions = positions.long().clamp_min(0) if positions is not None else window.dropped_tokens + torch.arange(
            window.compressed_tokens, device=vectors.device)
        vectors = engine.rope_keys(vectors[None], (layer,), positions[None] if positions.dim() > 1 else positions, inverse=False)[0].to(dtype)
    return vectors


def block_attention_stats(engine: CompressionEngine, members: tuple[int, ...], count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention mass and spike [G, B, H, count] of the observed queries on the block's tokens (the first
    ``count`` of each member's exact window), before the block is encoded."""
    observer = engine.observer
    reader = getattr(engine.kernel, "packed_logsumexp", None)
    if reader is not None and not engine.evicts:  # normalized over the packed tokens read in place
        stats = []
        for layer in members:
            window = engine.windows[layer]
            lse = None
            if window.compressed_tokens:
                lse = reader(engine.view(layer), observer.queries(layer), observer.scaling or engine.shape.head_dim**-0.5)
            stats.append(observer.attention_stats_exact(layer, window.exact["keys"], lse, count))
        return torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
    stats = [
        observer.attention_stats(
            layer, engine._materialize(layer, "keys"), count, engine.windows[layer].compressed_tokens,
            engine.eviction.key_valid(layer) if engine.evicts else None,
        )
        for layer in members
    ]
    return torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
