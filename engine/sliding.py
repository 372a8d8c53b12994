"""Sliding-window layers (Gemma-3: most layers see only their last ``window`` tokens) for
:class:`kvweave.engine.engine.CompressionEngine`: the basis groups without them, the window a layer kept
exactly keeps, and the blocks a compressed one drops. See docs/architecture.md.

``sliding_layers = "exact"`` (the default) keeps a sliding-window layer's last ``window - 1`` tokens as
computed, as transformers' own ``DynamicSlidingWindowLayer`` does, and never encodes it;
``sliding_layers = "compress"`` encodes it like the other layers and drops the stored blocks that no later
query can see.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvweave.core.errors import ModelError
from kvweave.core.interfaces import KINDS

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine
    from kvweave.engine.store import LayerWindow


def split_sliding(groups: list[tuple[int, ...]], sliding: dict[int, int], together: bool = False) -> list[tuple[int, ...]]:
    """A basis's layer ``groups`` with the sliding-window layers taken out: each into a group of its own (it
    keeps its window exactly, never encoded), or with ``together`` the sliding members of a group into one
    group (they are compressed, and drop their old blocks together); the other members stay together."""
    if not sliding:
        return groups
    split: list[tuple[int, ...]] = []
    for members in groups:
        kept = tuple(layer for layer in members if layer not in sliding)
        windowed = tuple(layer for layer in members if layer in sliding)
        split += [kept] if kept else []
        split += ([windowed] if windowed else []) if together else [(layer,) for layer in windowed]
    return split


def check_compress_sliding(engine: CompressionEngine, where: str) -> None:
    """sliding_layers = "compress" drops whole stored blocks from the front of a group's coefficients:
    refuse what indexes stored tokens from position 0 (residual lists, slots re-selected or scored over
    their whole history) or groups whose sliding-window layers have different windows. Other evictors
    drop tokens in the full-attention layers only (a sliding-window layer's window bounds it already)."""
    if engine.residual_levels or engine.reselects or engine.accumulates:
        part = "slot 'router' gives residual ranks" if engine.residual_levels else (
            f"slot 'evictor' ('{engine.pipeline.use('evictor')}') re-selects or scores every stored token")
        raise ModelError(
            f"{where}: setting sliding_layers = 'compress' drops the blocks that leave a sliding window, but its {part}, "
            "which index stored tokens from the first; use sliding_layers 'exact'"
        )
    for members in engine.groups:
        windows = {engine.sliding[layer] for layer in members if layer in engine.sliding}
        if len(windows) > 1:
            raise ModelError(f"{where}: layers {members} share a basis group but have sliding windows {sorted(windows)}")


def kept_tokens(sliding: dict[int, int], tokens: int, where: str) -> dict[int, int]:
    """Per sliding-window layer, the tokens it keeps: ``window - 1`` (what its next queries can see, as
    the model's own cache keeps them), or the ``sliding_tokens`` setting's shorter count. A setting that
    cannot apply (no sliding-window layer, a count past a window) is refused."""
    if not tokens:
        return {layer: window - 1 for layer, window in sliding.items()}
    if not sliding:
        raise ModelError(
            f"{where}: setting sliding_tokens = {tokens} shortens a model's sliding-window layers, but this model has "
            "none (every layer attends over all tokens); use sliding_tokens = 0")
    longest = min(sliding.values()) - 1
    if tokens > longest:
        raise ModelError(
            f"{where}: setting sliding_tokens = {tokens} is more than the {longest} tokens this model's sliding-window "
            f"layers keep (window {longest + 1}); it can only shorten them")
    return {layer: tokens for layer in sliding}


def slide(window: LayerWindow, keep: int) -> None:
    """Keep the last ``keep`` tokens of a sliding-window layer (what its next queries can see)."""
    extra = window.exact_tokens - keep
    if extra > 0:
        for kind in KINDS:
            window.exact.drop_front(kind, extra)
        window.passed_tokens += extra
        window.dropped_tokens += extra


def drop_outside_window(engine: CompressionEngine, group_index: int) -> None:
    """sliding_layers = "compress": drop the stored blocks of a sliding-window group that no later query
    can see (every token before the last ``window - 1``, or ``sliding_tokens``), whole blocks at a time."""
    members = engine.groups[group_index]
    first = engine.windows[members[0]]
    total = first.passed_tokens + first.exact_tokens
    block = engine.settings.block_tokens
    count = min(first.compressed_tokens, (total - engine.sliding_keep[members[0]] - first.dropped_tokens) // block * block)
    if count <= 0:
        return
    for kind in KINDS:
        engine.stores[group_index][kind].coefficients.drop_front(count)
    for layer in members:
        engine.windows[layer].compressed_tokens -= count
        engine.windows[layer].dropped_tokens += count
