"""What a router sees of one block (:class:`RouteBlock`), kept apart from the component interfaces
(:mod:`kvweave.core.interfaces` exports it too)."""

from __future__ import annotations

import attrs

from kvweave.core.lazy import torch


@attrs.frozen
class RouteBlock:
    """What a router sees of one block of one basis group, for keys or for values.

    ``vectors`` [G, B, H, n, D] float32; ``attention_mass`` and ``attention_spike`` [G, B, H, n] (the
    summed and the largest attention probability the observed recent queries give each token, over the
    query heads of each KV head), present when the router sets ``needs_attention``; ``boundary`` [B, n]
    (1.0 where the token is a delimiter or an instruction boundary), present when the cache knows the
    token ids; ``probe_error`` [G, H], the last attention-output error the probe measured (zeros before
    the first probe); ``level_bytes`` the stored bytes of one residual entry at each rank level > 0;
    ``budget_bytes`` the bytes this block's residuals may take (None: no budget); ``miss`` [G, B, H, n],
    the relative error ``||x - x_hat|| / ||x||`` of each vector after its packed coefficients.

    Also, for routers that work on logits or on the basis's residual rows: ``approx`` [G, B, H, n, D] the
    vectors as decoded from the packed coefficients (before residuals; read it inside ``assign``: the engine then adds
    the block's residuals into the same tensor); ``rows`` [G, B, H, n, D] what the
    ranks apply to (the misses, or ``M^-1`` of them when the basis has a ``residual_mixing`` ``mixing``
    [G, G]; a row whose column of ``mixing`` is constant over the layers is a depth-constant part, e.g.
    the DC row of a DCT); ``queries``
    [G, B, Hq, P, D] observed queries of each layer (the probe's selection when it made one, else the
    recent ones) with their logical positions ``query_positions`` [G, B, P] and softmax ``query_scale``;
    ``first`` the logical position of the block's first token; ``state`` a dict kept per basis group
    across blocks (shared by keys and values; the keys block is routed first).
    """

    layers: tuple[int, ...]
    kind: str
    vectors: torch.Tensor
    level_bytes: dict[int, float]
    budget_bytes: float | None = None
    attention_mass: torch.Tensor | None = None
    attention_spike: torch.Tensor | None = None
    boundary: torch.Tensor | None = None
    probe_error: torch.Tensor | None = None
    miss: torch.Tensor | None = None
    approx: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    mixing: torch.Tensor | None = None
    queries: torch.Tensor | None = None
    query_positions: torch.Tensor | None = None
    query_scale: float | None = None
    first: int = 0
    state: dict | None = None
