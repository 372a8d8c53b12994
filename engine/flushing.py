"""A basis group's flush: its oldest whole blocks leave the exact windows for the store (encoded, evicted or
reselected), and what their storage was kept for is dropped after (:class:`kvweave.engine.engine.CompressionEngine`'s
``_flush`` wraps these in its checks and products precision)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvweave.core.interfaces import KINDS
from kvweave.core.storage import stack_layers
from kvweave.engine.checks import check_finite
from kvweave.engine.sliding import drop_outside_window

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


def flush_block(engine: CompressionEngine, group_index: int) -> None:
    """Store group ``group_index``'s ready tokens: every whole block past ``recent_window`` in all of its layers."""
    members = engine.groups[group_index]
    ready = min(engine.windows[layer].exact_tokens for layer in members) - engine.settings.recent_window
    count = (ready // engine.settings.block_tokens) * engine.settings.block_tokens
    if count <= 0:
        return
    check_finite(engine, members, count)
    # attention statistics need the keys as they are before this block is encoded (once for K and V)
    wants_stats = (engine.router.needs_attention and engine.residual_levels) or (engine.evicts and engine.evictor.needs_attention)
    stats = engine._attention_stats(members, count) if wants_stats else None
    if engine.reselects:
        engine.eviction.reselect(group_index, count)
    elif engine.evicts and not (engine.compress_sliding and members[0] in engine.sliding):  # a window bounds those
        engine.eviction.evict(group_index, count, stats)
    else:
        passed = engine.windows[members[0]].passed_tokens
        positions = torch.arange(passed, passed + count, device=engine.windows[members[0]].exact.device)
        for kind in KINDS:
            parts = [engine.windows[layer].exact.head(kind, count) for layer in members]
            block = stack_layers(parts)  # one layer: no copy
            engine.encoder.encode(kind, group_index, block, stats, positions)
        for layer in members:
            engine.windows[layer].compressed_tokens += count
    engine._flushed(members, count, group_index == engine.last_flushing, group_index)


def flushed(engine: CompressionEngine, members: tuple[int, ...], count: int, last: bool, group_index: int | None = None) -> None:
    """After ``members``' first ``count`` window tokens are stored (or dropped): they leave the windows, what kept
    their previous storage is dropped, and after the forward's ``last`` flush the probes' shares and the budget
    move. ``group_index``: the group of a sliding-window layer compressed too (its window drops older blocks)."""
    for layer in members:
        window = engine.windows[layer]
        for kind in KINDS:
            window.exact.drop_front(kind, count)
        window.passed_tokens += count
    if group_index is not None and engine.compress_sliding and members[0] in engine.sliding:
        drop_outside_window(engine, group_index)
    engine.kernel.storage_changed(engine.kernel_state, members)
    engine.observer.forget_selection(members)
    engine.observer.forget_boundaries(min(w.passed_tokens for w in engine.windows))
    if engine.evicts and not engine.residual_levels and not engine.probe.needs_queries:
        engine.observer.forget_queries(members)  # eviction uses only the queries of the forward that flushes
    if last:
        engine.encoder.apply_probe_shares()
        engine._budget_warned = engine._budget_warned or engine.budget.check_met(engine)
