"""A model's attention modules and the queries they compute, for scorers that read attention outside the forward
(context importance, engine/importance.py; induction scores, engine/copying.py; tools/metrics.py)."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.core.errors import CacheStateError


def attention_modules(model: Any) -> list[Any]:
    """The model's attention modules (those with ``q_proj`` and ``layer_idx``), in layer order."""
    modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
    if not modules:
        raise CacheStateError(f"{type(model).__name__} has no attention modules with q_proj and layer_idx to score a context with")
    return sorted(modules, key=lambda m: int(m.layer_idx))


def module_queries(module: Any, hidden: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The post-RoPE queries [B, Hq, q, D] an attention module computes from ``hidden`` [B, q, C] (its
    ``q_norm`` too, where the model has one), with the module's own ``position_embeddings`` (cos, sin)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    cos, sin = position_embeddings
    query = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim)
    if hasattr(module, "q_norm"):
        query = module.q_norm(query)
    query = query.transpose(1, 2)
    rotated, _ = apply_rotary_pos_emb(query, query, cos, sin)
    return rotated
