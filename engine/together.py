"""A prompt's evicting flushes of one-layer groups stored in one pass instead of one pass a layer.

Where a scored context is stored without a forward (:mod:`kvweave.engine.ingest`), every layer's block leaves the
exact window at once. Flushed layer by layer, each layer's flush is a few hundred small torch operations and a host
read, and on a GPU the host's time in them, not the device's, sets the time to first token (on Llama-3-8B's shape at
32K tokens, ~20 ms a layer). :func:`flush_together` asks the evictor once for the layers of a call (an evictor whose
``keep`` is ``layer_local``), reads their slot counts in one host read, and stores layers of similar counts as one
block. An ingest's calls share a :class:`Plan`: an evictor that reads no keys (kvzip's cut comes from the context's
scores) is asked for every layer at the first call, so the context costs one host read and the later calls never wait
on the device. A pass stores the layers as one block: one gather, one quantizer call, one residual encoding for all of them. Each layer then keeps its own count of
slots (the quantizer's ``leading_tokens``, copied out so no layer holds another's bytes), and the cache stores
exactly what the layer-by-layer flushes store (tested bit for bit).

:func:`together_refusal` says why a cache's flushes cannot go together (then they go layer by layer): what a flush
reads beyond its block (attention statistics, a probe, accumulated scores), a basis that is not the
identity, a router whose ranks are not fixed by position within the first positions the evictor always keeps, or
quantizers that differ between layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.interfaces import KINDS
from kvweave.core.storage import stack_layers
from kvweave.engine.checks import check_finite

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine

#: the most bytes of float32 keys in one pass (a longer prompt's layers go a few at a time) on a GPU, where a pass's
#: launches cost the host the same whatever its size: 4 layers of Llama-3-8B's shape at 32K tokens (on an H100,
#: 8 layers a pass stored the context in 0.130 s with 6.1 GiB above the start, 2 layers in 0.152 s with 1.8 GiB)
PASS_BYTES = 512 << 20
#: the same off a GPU, where the host runs the arithmetic too and a pass that outgrows the caches runs each operation
#: at memory speed (on a 2-core CPU at 2,048 tokens: 0.288 s with every layer in one pass, 0.254 s at 8 MiB)
PASS_BYTES_HOST = 8 << 20
#: layers share a pass while the largest slot count is at most this much above the smallest (the smaller ones'
#: padding is quantized and dropped)
PAD_RATIO = 1.25
#: bytes a token and head of one layer's decision holds without its keys (its scores as float64, their order and
#: ranks as int64, the masks), for how many layers are decided at once
DECISION_BYTES = 40


def together_refusal(engine: CompressionEngine, groups: list[int]) -> str | None:
    """Why the flushes of ``groups``, whose layers are about to receive the same tokens into empty windows, cannot be
    stored in one pass (None: they can)."""
    if not groups:
        return "no group flushes"
    if any(len(engine.groups[g]) != 1 for g in groups):
        return "a basis group of several layers"
    if not engine.evicts or engine.reselects or engine.accumulates or not engine.evictor.layer_local:
        return "its evictor does not decide each layer alone at the flush"
    if engine.evictor.needs_attention or (engine.router.needs_attention and engine.residual_levels):
        return "it reads the recent queries' attention"
    if engine.compress_sliding or engine.rows is not None or engine.padding is not None:
        return "sliding, split or padded rows"
    if not engine.basis.identity or engine.kernel.builds_residual_tiles:
        return "its basis or its kernel's residual tiles work a group at a time"
    if any(engine.probe.wants(engine.stores[g][kind].flushes) for g in groups for kind in KINDS):
        return "its probe measures the block"
    for kind in KINDS:
        first = engine.quantizer(groups[0], kind)
        if any(engine.quantizer(g, kind) != first for g in groups):
            return f"its layers' {kind} quantizers differ"
    if any(engine.windows[engine.groups[g][0]].passed_tokens or engine.windows[engine.groups[g][0]].exact_tokens for g in groups):
        return "its layers hold tokens already"
    if engine.residual_levels:
        if engine.settings.residual_mode == "basis" or engine.basis.residual_mixing(1) is not None:
            return "its residuals are fitted or mixed from whole blocks"
        lead = max(0, int(engine.evictor.kept_leading()))
        for kind in KINDS:
            runs = engine.router.fixed_ranks(kind, 0, engine.settings.block_tokens)
            if runs is None or any(int(stop) > lead for _, stop, _ in runs):
                return "its router reads the kept tokens"
    return None


@dataclass
class Plan:
    """What every layer of an ingest's flushes keeps, decided once: ``groups``, the one-layer groups the ingest will
    flush together (in calls of a few); where the evictor does not read the keys (``Evictor.reads_keys``), the first
    call decides for all of them, with one host read for the whole context, so the later calls store without waiting
    on the device."""

    groups: list[int]
    passed: int = -1
    exact: int = -1
    placed: int = 0
    keeps: dict[int, torch.Tensor] = field(default_factory=dict)
    slots: dict[int, int] = field(default_factory=dict)


def flush_together(engine: CompressionEngine, groups: list[int], plan: Plan | None = None) -> None:
    """Flush the ready block of every group in ``groups`` (one-layer groups for which :func:`together_refusal` says
    None) as the engine's ``_flush`` would, one after another, with its checks read once at the end; ``plan``: the
    decisions of an ingest's earlier calls, kept for its later ones (None: these groups decide alone)."""
    with engine.deferred.collecting(engine._defers(engine.windows[engine.groups[groups[0]][0]].exact.device)):
        _flush_together(engine, groups, Plan(list(groups)) if plan is None else plan)
    if engine.last_flushing in groups:
        engine.deferred.resolve()


def _flush_together(engine: CompressionEngine, groups: list[int], plan: Plan) -> None:
    settings = engine.settings
    layers = [engine.groups[g][0] for g in groups]
    first = engine.windows[layers[0]]
    held = {(engine.windows[layer].passed_tokens, engine.windows[layer].exact_tokens) for layer in layers}
    if len(held) != 1 or (plan.slots and held != {(plan.passed, plan.exact)}):
        raise CacheStateError(f"flush_together: layers {layers} hold different tokens; their flushes cannot go together")
    ready = first.exact_tokens - settings.recent_window
    count = (ready // settings.block_tokens) * settings.block_tokens
    if count <= 0:
        return
    per_pass = layers_a_pass(engine, count, first.exact.shape()[0], first.exact.device)
    if any(layer not in plan.slots for layer in layers):
        ahead = [] if engine.evictor.reads_keys else [engine.groups[g][0] for g in plan.groups if g not in groups]
        _decide(engine, groups[0], layers, ahead, count, per_pass, plan)
    check_finite(engine, tuple(layers), count)  # an int8 window's from its scales: no token decoded for it
    for members in _passes(layers, plan.slots, per_pass):
        _store(engine, members, [plan.slots[layer] for layer in members], plan.keeps, count, plan.passed, plan.placed)
    for layer in layers:  # stored: its mask of kept tokens is not needed again
        del plan.keeps[layer]
    engine._flushed(tuple(layers), count, engine.last_flushing in groups)


def _decide(engine: CompressionEngine, group: int, layers: list[int], ahead: list[int], count: int, per_pass: int,
            plan: Plan) -> None:
    """Which tokens ``layers`` (their windows holding the context) and ``ahead`` (whose windows will hold the same
    tokens: decided from the context's scores, the evictor reading no keys) keep, a few layers at a time, and how many
    slots each stores: one host read."""
    eviction = engine.eviction
    first = engine.windows[layers[0]]
    passed, device = first.passed_tokens, first.exact.device
    batch, heads = first.exact.shape()[0], engine.shape.num_kv_heads
    every = layers + ahead
    keyless = not engine.evictor.reads_keys
    # without keys a layer's decision holds a few float64 and int64 copies of its scores, not its float32 keys
    at_once = max(1, _limit(device) // max(1, batch * heads * count * DECISION_BYTES)) if keyless else per_pass
    counts = []
    for start in range(0, len(every), at_once):
        part = tuple(every[start : start + at_once])
        if keyless:
            work = torch.empty((len(part), batch, heads, count, 0), device=device)
        else:
            work = torch.stack([engine.windows[layer].exact.head("keys", count) for layer in part]).float()
        logical = torch.arange(passed, passed + count, device=device).expand(work.shape[:-1])
        route = eviction._eviction_block(group, work, logical, None, None, 0, members=part, like=layers[0])
        keep = eviction.evictor.keep(route)
        eviction._check_keep(keep, work.shape[:-1])
        del work
        keep = eviction._whole_groups(group, keep, route, per_layer=True)
        # the same for every part (the evictor's promise at this block's start); each part's keep is checked against it
        plan.placed = eviction._placed_leading(group, passed, keep, members=part)
        counts.append(keep.sum(-1).amax(dim=(1, 2)))  # [G]: each layer's slots, its most kept of any row and head
        for index, layer in enumerate(part):
            plan.keeps[layer] = keep[index]
    plan.slots.update(zip(every, torch.cat(counts).tolist()))
    plan.passed, plan.exact = passed, first.exact_tokens


def layers_a_pass(engine: CompressionEngine, tokens: int, batch: int, device: torch.device) -> int:
    """How many layers' blocks of ``tokens`` tokens one pass holds: :data:`PASS_BYTES` of float32 keys on a GPU,
    :data:`PASS_BYTES_HOST` elsewhere."""
    layer = batch * engine.shape.num_kv_heads * tokens * engine.shape.head_dim * 4
    return max(1, _limit(device) // max(1, layer))


def _limit(device: torch.device) -> int:
    return PASS_BYTES if device.type == "cuda" else PASS_BYTES_HOST


def _passes(layers: list[int], slots: dict[int, int], per_pass: int) -> list[tuple[int, ...]]:
    """Layers of similar slot counts together (at most ``per_pass`` a pass); layers keeping nothing alone."""
    order = sorted(layers, key=lambda layer: slots[layer])
    out: list[list[int]] = []
    for layer in order:
        current = out[-1] if out else None
        if (current is None or len(current) >= per_pass or slots[current[0]] == 0
                or slots[layer] > PAD_RATIO * slots[current[0]]):
            out.append([layer])
        else:
            current.append(layer)
    return [tuple(members) for members in out]


def _store(engine: CompressionEngine, members: tuple[int, ...], counts: list[int], keeps: dict, count: int,
           passed: int, placed: int) -> None:
    """Gather, encode and store the kept tokens of ``members`` (each keeping ``counts`` slots) as one block."""
    slots = max(counts)
    groups = [engine.group_of[layer][0] for layer in members]
    keep = torch.stack([keeps[layer] for layer in members])  # [G, B, H, n]
    index = ((~keep).long() * count + torch.arange(count, device=keep.device)).argsort(dim=-1)[..., :slots]
    kept = keep.gather(-1, index)
    at = torch.arange(passed, passed + count, device=keep.device).expand(keep.shape).gather(-1, index)  # kept positions
    positions = torch.where(kept, at, -1)
    if slots:
        gathered = {kind: _kept_tokens(engine, members, kind, count, index) for kind in KINDS}
        engine._flush_info = {"count": count, "dropped": count - slots, "kept_index": index, "blocks": gathered,
                              "placed": min([placed, *counts])}
        try:
            for kind in KINDS:
                _encode(engine, kind, groups, members, gathered[kind], counts, at)
        finally:
            engine._flush_info = None
    for member, layer in enumerate(members):
        window = engine.windows[layer]
        window.slot_index.append(positions[member, ..., : counts[member]], passed, count)
        window.compressed_tokens += counts[member]


def _kept_tokens(engine: CompressionEngine, members: tuple[int, ...], kind: str, count: int,
                 index: torch.Tensor) -> torch.Tensor:
    """The window tokens ``index`` [G, B, H, k] names among the first ``count`` of each of ``members`` [G, B, H, k, D],
    gathered as the window holds them (an int8 window's codes and scales) and only those decoded: what gathering the
    decoded windows gives, bit for bit, at a fraction of the passes over the block."""
    windows = [engine.windows[layer].exact for layer in members]
    held = [stack_layers(list(parts)) for parts in zip(*(window.encoded(kind, count) for window in windows))]
    return windows[0].decoded(tuple(engine.eviction._gather_tokens(part, index) for part in held))


def _encode(engine: CompressionEngine, kind: str, groups: list[int], members: tuple[int, ...], block: torch.Tensor,
            counts: list[int], positions: torch.Tensor) -> None:
    """What :meth:`kvweave.engine.encoder.BlockEncoder.encode` does for each one-layer group, for all of them at once:
    ``block`` [G, B, H, k, D] holds member ``m``'s ``counts[m]`` slots first."""
    encoder = engine.encoder
    slots = block.shape[-2]
    if engine.pre_rope and kind == "keys":
        block = engine.rope_keys(block, members, positions, inverse=True).to(block.dtype)
    quantizer = engine.quantizer(groups[0], kind)
    packed = encoder.quantize(kind, quantizer, members, block)
    for member, group in enumerate(groups):
        store = engine.stores[group][kind]
        if store.state is None:
            store.state = engine.basis.init_state(block[member : member + 1, ..., :0, :])
        own = {name: field[member : member + 1] for name, field in packed.items()}
        if counts[member] < slots:
            own = quantizer.leading_tokens(own, counts[member], slots)
        store.coefficients.append({name: field.clone(memory_format=torch.contiguous_format) for name, field in own.items()})
        store.flushes += 1
    if not engine.residual_levels:
        return
    head = encoder.routed_head(kind, groups[0], slots, quantizer)
    if head == 0:
        return
    fixed = encoder.fixed_ranks(kind, groups[0], head, None)
    if fixed is None:  # together_refusal checked the router's runs against the evictor's kept positions before
        raise CacheStateError(f"pipeline '{engine.pipeline.name}': layers {list(members)} were flushed together, but their "
                              f"router '{engine.pipeline.use('router')}' gives no ranks fixed within the positions the evictor keeps")
    rows = block.shape[1] * block.shape[2]
    counts_by_rank, ends = encoder.fixed_counts(fixed, rows, len(members))
    if head < slots:
        packed = quantizer.leading_tokens(packed, head, slots)
    work = block[..., :head, :].float()
    missing = (work - quantizer.dequantize(packed, torch.float32)).to(block.dtype)
    entries = encoder.encode_members(kind, members, missing, fixed, counts_by_rank, engine.residual_quantizers[kind])
    encoder.append_entries(kind, members, entries, ends, counts, rows)
