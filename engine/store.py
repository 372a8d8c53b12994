"""The engine's stored state: one :class:`LayerWindow` per layer (exact recent tokens, routed residuals,
counts) and one :class:`GroupStore` per basis group and kind (packed coefficients, basis state, budget
share). Only the engine and its collaborators write them; everything else reads a
:class:`~kvweave.core.view.LayerView`.
"""

from __future__ import annotations

import torch

from kvweave.core.interfaces import KINDS
from kvweave.core.storage import Segment, TensorMap
from kvweave.engine.exact import ExactTokens
from kvweave.engine.residuals import ResidualList
from kvweave.engine.slot_index import SlotIndex


class LayerWindow:
    """One layer's exact (uncompressed) recent tokens, its routed residuals, and its packed-token count."""

    def __init__(self, levels: tuple[int, ...], window_storage: str = "input", slot_bits: bool = True,
                 residual_tiles: bool = False) -> None:
        self.exact = ExactTokens(window_storage)
        # residual_tiles: each list keeps the kernels' tile index as blocks arrive (a kernel that reads them in place)
        self.residuals = {kind: {rank: ResidualList(rank, residual_tiles) for rank in levels if rank > 0} for kind in KINDS}
        self.residual_basis: dict[str, torch.Tensor | None] = {kind: None for kind in KINDS}  # [B, H, R, D]
        self.compressed_tokens = 0  # stored (packed) slots per batch row and head
        self.passed_tokens = 0  # logical tokens that left the exact window (stored or dropped)
        self.dropped_tokens = 0  # sliding-window layers: logical tokens no longer held (before the first held one)
        # eviction: the cache index (logical position) of each stored slot, -1 for a filler slot, in the fewer
        # bytes of a list or a bit per passed token (slot_index.SlotIndex; read decoded through ``positions``)
        self.slot_index = SlotIndex(bits=slot_bits)
        # routers that accumulate attention: what every query gave each stored slot, then each exact token
        self.scores: torch.Tensor | None = None  # float32 [B, H, compressed_tokens + exact_tokens]

    @property
    def exact_tokens(self) -> int:
        return self.exact.tokens()

    @property
    def positions(self) -> torch.Tensor | None:
        """int16/int32 [B, H, compressed_tokens]: each stored slot's cache index (-1: filler), decoded for the
        caller; None while the layer never dropped a token."""
        return self.slot_index.positions


class GroupStore:
    """Packed coefficients of one basis group for keys or values, plus the basis state they decode with."""

    def __init__(self) -> None:
        self.state: TensorMap | None = None
        self.coefficients = Segment()
        self.flushes = 0
        self.share = 1.0
        self.next_share: float | None = None
        self.pending_errors: list[torch.Tensor] = []  # probe errors [G, H] whose share moves at the forward's end
        self.probe_state: dict[str, float] = {}
        self.probe_error: torch.Tensor | None = None
        self.route_state: dict = {}  # the router's per-group state (RouteBlock.state; tensors batch-first)


def select_rows(windows: list[LayerWindow], stores: list[dict[str, GroupStore]], index: torch.Tensor, heads: int) -> None:
    """Keep batch rows ``index`` [B'] (reordering and repeats allowed) of every tensor held in ``windows``
    and ``stores`` (``heads`` KV heads per row in the residual lists)."""
    for window in windows:
        window.exact.select_rows(index)
        for kind in KINDS:
            for residuals in window.residuals[kind].values():
                residuals.select_batch(index, heads)
            if window.residual_basis[kind] is not None:
                window.residual_basis[kind] = window.residual_basis[kind].index_select(0, index.to(window.residual_basis[kind].device))
        window.slot_index.select_rows(index)
        if window.scores is not None:
            window.scores = window.scores.index_select(0, index.to(window.scores.device))
    for group in stores:
        for store in group.values():
            store.coefficients.map(lambda tensor: tensor.index_select(1, index.to(tensor.device)))
            if store.state:
                store.state = {name: t.index_select(0, index.to(t.device)) for name, t in store.state.items()}
            store.route_state.update({
                name: t.index_select(0, index.to(t.device))
                for name, t in store.route_state.items() if isinstance(t, torch.Tensor)
            })
