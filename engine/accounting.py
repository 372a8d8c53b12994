"""The stored bytes of a :class:`kvweave.engine.engine.CompressionEngine`, by part: every figure is the
``nbytes`` of a tensor the cache holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvweave.core.storage import tensor_bytes

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


def memory_breakdown(engine: CompressionEngine) -> dict[str, int]:
    """Stored bytes by part: exact window, coefficients, residuals (positions and indices included), basis
    state, the observation state of the router and probe (recent queries, token flags), eviction, and for a
    model with sliding-window layers kept uncompressed, their windows."""
    windows, kept = engine.windows, engine.kept_exact
    exact = [t for layer, w in enumerate(windows) if layer not in kept for t in w.exact.stored()]
    stores = [store for group in engine.stores for store in group.values()]
    parts = {
        "exact_window": tensor_bytes(exact),
        "coefficients": sum(store.coefficients.nbytes() for store in stores),
        "residuals": sum(r.nbytes() for w in windows for lists in w.residuals.values() for r in lists.values())
        + tensor_bytes(b for w in windows for b in w.residual_basis.values() if b is not None),
        "basis_state": tensor_bytes(t for store in stores for t in (store.state or {}).values()),
        "observation": engine.observer.nbytes() + (0 if engine.padding is None else tensor_bytes([engine.padding]))
        + (0 if engine.energy is None else engine.energy.nbytes()),
        # evicting pipelines: the cache index of every stored slot (a list or bits, with the bits' flush
        # records), and accumulated attention (H2O)
        "eviction": tensor_bytes(t for w in windows for t in [*w.slot_index.stored(), w.scores] if t is not None)
        + sum(w.slot_index.record_bytes() for w in windows),
    }
    if kept:  # sliding-window layers: their last window - 1 (or sliding_tokens) tokens, uncompressed
        parts["sliding_window"] = tensor_bytes(t for layer in kept for t in windows[layer].exact.stored())
    return parts
