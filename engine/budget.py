"""Byte budgets: what a router's ``target_reduction`` allows each block's residuals.

The target is against a 16-bit cache of the same tokens: ``2 * D`` bytes per key or value vector. Each
basis group holds its K storage (and its V storage) to its share of that, counting its packed
coefficients, basis state, residual entries and its layers' exact windows; a block's residuals get what
is left after its coefficients. A target that the coefficients alone exceed is refused when the cache
is built, with the largest reduction the components can reach.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import attrs
import torch

from kvweave.core.errors import BudgetError
from kvweave.core.interfaces import KINDS
from kvweave.engine.residuals import entry_bytes, index_bytes
from kvweave.core.storage import tensor_bytes

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


class BudgetWarning(UserWarning):
    """A cache holds more than its router's ``target_reduction`` allows (the exact window or the
    coefficients alone exceed it): emitted once per cache, naming the parts."""


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
        # coefficient bytes per key or value vector, averaged over the layers
        # (sliding-window layers keep the model's own window, outside any target)
        compressed = [(i, g) for i, g in enumerate(engine.groups) if g[0] not in engine.kept_exact]
        floor = sum(
            sum(engine.quantizer(i, kind).bytes_per_vector(width, torch.bfloat16) for kind in KINDS) / len(KINDS)
            * engine.basis.coefficient_rows(len(g)) for i, g in compressed
        ) / max(1, sum(len(g) for _, g in compressed))
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
        ``dropped_tokens``: tokens of the flush a router evicted; the budget counts stored tokens only.

        By default keys and values each keep to their half of the target. A router with ``pools_budget``
        (e.g. one that gives tiers to keys only) has one budget for both: the keys block, routed first,
        may take what the values' coefficients of the same block leave."""
        if self.target is None:
            return None
        shape = engine.shape
        members = engine.groups[group_index]
        first = engine.windows[members[0]]
        batch = first.exact.shape(kind)[0]
        tokens = first.compressed_tokens + first.exact_tokens - dropped_tokens
        vectors = batch * tokens * len(members) * shape.num_kv_heads
        if not engine.router.pools_budget:
            target_bytes = vectors * shape.head_dim * 2 / self.target * engine.stores[group_index][kind].share
            return max(0.0, target_bytes - self._held(engine, group_index, kind, block_tokens, dropped_tokens))
        target_bytes = sum(vectors * shape.head_dim * 2 / self.target * engine.stores[group_index][k].share for k in KINDS)
        held = sum(self._held(engine, group_index, k, block_tokens, dropped_tokens) for k in KINDS)
        if kind == KINDS[0]:  # the values of this block are encoded next: their coefficients are spoken for
            kept = block_tokens - dropped_tokens
            rows = engine.basis.coefficient_rows(len(members))
            per_vector = engine.quantizer(group_index, KINDS[1]).bytes_per_vector(engine.basis.coefficient_width(shape), first.exact.dtype)
            held += batch * shape.num_kv_heads * kept * rows * per_vector
        return max(0.0, target_bytes - held)

    @staticmethod
    def _held(engine: CompressionEngine, group_index: int, kind: str, block_tokens: int, dropped_tokens: int) -> float:
        """The bytes ``kind`` of a group holds now, the exact tokens of the block being encoded left out."""
        shape = engine.shape
        members = engine.groups[group_index]
        store = engine.stores[group_index][kind]
        batch = engine.windows[members[0]].exact.shape(kind)[0]
        held = store.coefficients.nbytes() + tensor_bytes((store.state or {}).values())
        for layer in members:
            window = engine.windows[layer]
            held += sum(r.nbytes() for r in window.residuals[kind].values())
            if window.residual_basis[kind] is not None:
                held += tensor_bytes([window.residual_basis[kind]])
            elif engine.settings.residual_mode == "basis" and engine.residual_levels:  # fitted on this block
                held += batch * shape.num_kv_heads * max(engine.residual_levels) * shape.head_dim * 2
            if engine.residual_levels:  # each level's index grows with this block (earlier blocks' is in the lists' bytes)
                grown = index_bytes(batch * shape.num_kv_heads, window.compressed_tokens, block_tokens - dropped_tokens,
                                    engine.kernel.builds_residual_tiles)
                held += grown * len(engine.residual_levels)
            held += (window.exact_tokens - block_tokens - dropped_tokens) * window.exact.bytes_per_token(kind)
            queries = engine.observer.queries(layer)
            if queries is not None:  # recent queries, split between keys and values
                held += queries.numel() * queries.element_size() / 2
        return held

    def check_met(self, engine: CompressionEngine) -> bool:
        """After a forward's flushes: warn when the cache holds more than the target allows with nothing
        left to take from residuals, e.g. a float32 model's exact window; whether it warned."""
        if self.target is None or engine.batch_size() <= 0:
            return False
        tokens = engine.seq_length(0)
        shape = engine.shape
        # against what the model's own cache holds, leaving out the windows kept exactly as it keeps them
        full_16bit = shape.own_cache_bytes_16bit(tokens, engine.batch_size(), exclude=engine.kept_exact)
        allowed = full_16bit / self.target
        breakdown = engine.memory_breakdown()
        stored = sum(breakdown.values()) - breakdown.get("sliding_window", 0)
        if stored <= allowed * 1.01:
            return False
        dtype = engine.windows[0].exact.dtype
        parts = ", ".join(f"{part} {size:,}" for part, size in breakdown.items() if size)
        remedy = "a shorter recent_window, window_storage = 'int8', a lower target_reduction or a longer context"
        if dtype.itemsize > 2:
            remedy = f"the exact window is held in the model's dtype ({str(dtype).removeprefix('torch.')}, twice a 16-bit cache's bytes): a 16-bit dtype, {remedy}"
        warnings.warn(BudgetWarning(
            f"pipeline '{engine.pipeline.name}': {tokens:,} tokens stored in {stored:,} bytes, "
            f"{full_16bit / stored:.2f}x against a 16-bit cache where "
            f"target_reduction asks {self.target:g}x ({parts}), with no budget left for residuals; {remedy} brings "
            "the cache to its target"
        ), stacklevel=2)
        return True

