"""``compose``: an eviction router followed by a residual-rank router, as one router slot.

Lets eviction baselines combine with factorized storage in one pipeline, e.g. ``snapkv-depthweave``:
SnapKV (Li et al., 2024, arXiv:2404.14469) decides which tokens are kept, and DepthWeave-KV's
``sigmoid-multilevel`` router (Córdoba et al., 2026, arXiv:2607.06523) gives the kept tokens their
residual ranks. The cache calls ``assign`` twice per flush: first on the whole block (``kept_index`` is
None; the ``evict`` router's DROPPED decisions are used), then, after the kept tokens are encoded, on
those only (``kept_index`` set; the ``rank`` router's ranks). The second call is split per KV head (and
per layer when the layers kept different tokens) so that the rank router sees a block whose tokens are
the same for every row it scores, with its delimiter flags gathered accordingly; the byte budget is
split evenly between the parts.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvweave.core import hookimpl
from kvweave.core.interfaces import DROPPED, ModelShape, RouteBlock, Router

TOKEN_FIELDS = ("vectors", "attention_mass", "attention_spike", "miss", "approx", "rows", "valid", "positions", "scores", "kept_index")


def _table(_instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, dict):
        raise TypeError(f"'{attribute.name}' must be a table of parameters, got {value!r}")


def _build(name: str, params: dict, parameter: str) -> Router:
    from kvweave.core import plugins
    from kvweave.core.errors import ComponentError

    if not isinstance(name, str):
        raise TypeError(f"'{parameter}' must be a registered router name, got {name!r}")
    try:
        info = plugins.catalog().get("routers", name)
    except ComponentError as exc:
        raise ValueError(f"'{parameter}': {exc}") from exc
    if info.name == "compose":
        raise ValueError(f"'{parameter}' cannot be 'compose' itself")
    try:
        return plugins.build_component(info, dict(params), f"router 'compose', '{parameter}' = '{name}'")  # type: ignore[return-value]
    except ComponentError as exc:
        raise ValueError(str(exc)) from exc


@attrs.frozen
class ComposeRouter(Router):
    """``evict`` (a router with a DROPPED level) chooses the kept tokens; ``rank`` their residual ranks."""

    evict: str = attrs.field(default="snapkv", metadata={"doc": "registered router that drops tokens"})
    evict_params: dict = attrs.field(factory=dict, validator=_table, metadata={"doc": "its parameters (a table)"})
    rank: str = attrs.field(default="sigmoid-multilevel", metadata={"doc": "registered router that ranks the kept tokens' residuals"})
    rank_params: dict = attrs.field(factory=dict, validator=_table, metadata={"doc": "its parameters (a table)"})
    _evictor: Router = attrs.field(init=False, default=None, repr=False, eq=False)
    _ranker: Router = attrs.field(init=False, default=None, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        evictor = _build(self.evict, self.evict_params, "evict")
        ranker = _build(self.rank, self.rank_params, "rank")
        if DROPPED not in evictor.levels():
            raise ValueError(f"'evict' = '{self.evict}' never drops a token (its levels {evictor.levels()} lack DROPPED)")
        if DROPPED in ranker.levels():
            raise ValueError(f"'rank' = '{self.rank}' drops tokens itself; put it under 'evict'")
        if evictor.reselects:
            raise ValueError(f"'evict' = '{self.evict}' re-selects stored tokens, which residual ranks cannot follow")
        object.__setattr__(self, "_evictor", evictor)
        object.__setattr__(self, "_ranker", ranker)

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return bool(self._evictor.needs_attention or self._ranker.needs_attention)

    @property
    def needs_boundaries(self) -> bool:  # type: ignore[override]
        return bool(self._evictor.needs_boundaries or self._ranker.needs_boundaries)

    @property
    def accumulates(self) -> bool:  # type: ignore[override]
        return bool(self._evictor.accumulates)

    def check_model(self, shape: ModelShape) -> None:
        self._evictor.check_model(shape)
        self._ranker.check_model(shape)

    def check_window(self, recent_window: int, block_tokens: int, where: str) -> None:
        self._evictor.check_window(recent_window, block_tokens, f"{where}, 'evict' = '{self.evict}'")

    def levels(self) -> tuple[int, ...]:
        return (DROPPED, *sorted(set(self._ranker.levels())))

    def target_reduction(self) -> float | None:
        return self._ranker.target_reduction()

    def gates(self, layer: int, kind: str) -> torch.Tensor | None:
        return self._ranker.gates(layer, kind)

    def assign(self, block: RouteBlock) -> torch.Tensor:
        if block.kept_index is None:
            ranks = self._evictor.assign(block)
            return torch.where(ranks == DROPPED, DROPPED, 0).long()
        kept = block.kept_index
        same = all(torch.equal(kept[g], kept[0]) for g in range(kept.shape[0]))
        parts = [(slice(None), h) for h in range(kept.shape[2])] if same else [
            (slice(g, g + 1), h) for g in range(kept.shape[0]) for h in range(kept.shape[2])
        ]
        ranks = torch.zeros(block.vectors.shape[:-1], dtype=torch.long, device=block.vectors.device)
        for rows, head in parts:
            ranks[rows, :, head : head + 1] = self._ranker.assign(self._part(block, rows, head, len(parts)))
        return ranks

    @staticmethod
    def _part(block: RouteBlock, rows: slice, head: int, parts: int) -> RouteBlock:
        """The sub-block of layers ``rows`` and KV head ``head``, delimiter flags gathered to its tokens."""
        changes: dict[str, Any] = {}
        for name in TOKEN_FIELDS:
            value = getattr(block, name, None)
            if isinstance(value, torch.Tensor):
                changes[name] = value[rows, :, head : head + 1]
        layers = block.layers[rows]
        changes["layers"] = tuple(layers)
        if block.probe_error is not None:
            changes["probe_error"] = block.probe_error[rows, head : head + 1]
        if block.boundary is not None:
            index = block.kept_index[rows][0, :, head]  # [B, k]: the part's layers keep the same tokens
            changes["boundary"] = block.boundary.gather(-1, index.to(block.boundary.device))
        if block.budget_bytes is not None:
            changes["budget_bytes"] = block.budget_bytes / parts
        if getattr(block, "queries", None) is not None:  # per query head; not split here
            changes["queries"] = None
        return attrs.evolve(block, **changes)


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("compose", ComposeRouter)
