"""Byte budgets: what a router's ``target_reduction`` allows each block's residuals.

The target is against a 16-bit cache of the same tokens: ``2 * D`` bytes per key or value vector. Each
basis group holds its K storage (and its V storage) to its share of that, counting its packed
coefficients, basis state, residual entries and its layers' exact windows; a block's residuals get what
is left after its coefficients. A target that the coefficients alone exceed is refused when the cache
is built, with the largest reduction the components can reach.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import torch

from kvweave.core.errors import BudgetError
from kvweave.core.interfaces import KINDS
from kvweave.engine.residuals import TILE_TOKENS, entry_bytes
from kvweave.core.storage import tensor_bytes

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


@attrs.frozen
class BudgetPlan:
    """The target (None: no budget) and, per kind, the bytes of one residual entry at each rank level."""

    target: float | None
    level_bytes: dict[str, dict[int, float]]

    @classmethod
    def for_engine(cls, engine: CompressionEngine) -> BudgetPlan:
        indexed = engine.settings.residual_mode == "channels"
        levels = {  # a full-rank entry stores no channel indices (engine/residuals.py)
            kind: {
                rank: entry_bytes(rank, engine.residual_quantizers[kind], indexed and rank < engine.shape.head_dim)
                for rank in engine.levels if rank > 0
            }
            for kind in KINDS
        }
        target = engine.router.target_reduction()
        if target is None:
            return cls(None, levels)
        shape = engine.shape
        width = engine.basis.coefficient_width(shape)
        per_vector = sum(engine.quantizers[kind].bytes_per_vector(width, torch.bfloat16) for kind in KINDS) / len(KINDS)
        # coefficient bytes per key or value vector, averaged over the layers
        floor = sum(per_vector * engine.basis.coefficient_rows(len(g)) for g in engine.groups) / shape.num_layers
        allowed = 2 * shape.head_dim / target
        if floor >= allowed:
            slots = engine.pipeline.slots
            raise BudgetError(
                f"pipeline '{engine.pipeline.name}': a {target:g}x reduction leaves {allowed:.2f} bytes per key or value "
                f"vector (head_dim {shape.head_dim}), but the coefficients alone take {floor:.2f} (basis "
                f"'{slots['basis'].use}' width {width}, quantizer '{engine.pipeline.use(engine.pipeline.slot_for('quantizer', 'keys'))}'), before any residual, "
                f"window or basis state; these components reach at most {2 * shape.head_dim / floor:.1f}x. Lower "
                "target_reduction in the router slot, or the basis rank"
            )
        return cls(float(target), levels)

    def residual_budget(
        self, engine: CompressionEngine, group_index: int, kind: str, block_tokens: int, dropped_tokens: int = 0
    ) -> float | None:
        """Bytes the residuals of the block now being encoded may take (its coefficients already stored).
        ``dropped_tokens``: tokens of the flush a router evicted; the budget counts stored tokens only."""
        if self.target is None:
            return None
        shape = engine.shape
        members = engine.groups[group_index]
        store = engine.stores[group_index][kind]
        first = engine.windows[members[0]]
        batch = first.exact[kind].shape[0]
        tokens = first.compressed_tokens + first.exact_tokens - dropped_tokens
        target_bytes = batch * tokens * len(members) * shape.num_kv_heads * shape.head_dim * 2 / self.target * store.share
        held = store.coefficients.nbytes() + tensor_bytes((store.state or {}).values())
        for layer in members:
            window = engine.windows[layer]
            held += sum(r.nbytes() for r in window.residuals[kind].values())
            if window.residual_basis[kind] is not None:
                held += tensor_bytes([window.residual_basis[kind]])
            elif engine.settings.residual_mode == "basis" and engine.residual_levels:  # fitted on this block
                held += batch * shape.num_kv_heads * max(engine.residual_levels) * shape.head_dim * 2
            if engine.residual_levels and not engine.kernel.materializes:
                # the kernel's residual tile index grows with this block: int32 start + int32 mask per
                # (row, 32-token tile) and level (the index of earlier blocks is in the lists' bytes)
                held += batch * shape.num_kv_heads * (block_tokens // TILE_TOKENS) * 8 * len(engine.residual_levels)
            exact = window.exact[kind]
            held += (exact.shape[-2] - block_tokens - dropped_tokens) * exact[..., :1, :].numel() * exact.element_size()
            queries = engine.observer.queries(layer)
            if queries is not None:  # recent queries, split between keys and values
                held += queries.numel() * queries.element_size() / 2
        return max(0.0, target_bytes - held)
