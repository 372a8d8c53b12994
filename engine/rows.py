"""Per-row storage for a left-padded batch: each row of the batch kept by an engine of its own.

A compressing pipeline cuts its tokens into blocks, keeps a recent window exact and, for some components,
shares statistics over the rows of a block (budgets, bases, scale groups over tokens). In one storage for
the whole batch a left-padded row's padding counts toward its blocks, so its blocks, window and shared
statistics are not the ones it has alone, and it can generate other tokens. When the first forward of an
empty cache carries a left-padded attention mask, the engine hands every row to an engine of its own
(:class:`RowSplit`): row ``i`` stores exactly its real tokens, at the positions it has alone, and what it
stores and returns is what it stores and returns alone. The padding itself is not stored.

``update`` returns the rows' keys and values right-aligned in one tensor (zeros where a row has padding,
which the model's mask hides); where kvweave's attention serves the pipeline (observed queries, kernels
that read the packed storage), it attends row by row with each row's own engine
(:func:`kvweave.engine.observation._observing_attention`). Models with sliding-window layers are not split
(docs/architecture.md).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.interfaces import KINDS
from kvweave.engine.binding import TokenTap


def left_padding(mask: torch.Tensor) -> list[int] | None:
    """Padding tokens at the start of each row of a 2-D mask [B, T] (None when no row is padded); a mask
    that hides a token after a visible one is refused."""
    allowed = mask.bool()
    pads = (~allowed).long().cumprod(dim=-1).sum(dim=-1)
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    if not bool((allowed == (positions[None, :] >= pads[:, None])).all()):
        raise CacheStateError("the attention mask hides a token after a visible one; kvweave caches take left padding only")
    if not bool(pads.any()):
        return None
    if bool((pads >= allowed.shape[-1]).any()):
        raise CacheStateError("a row of the batch is all padding; give every row at least one token")
    return [int(p) for p in pads.tolist()]


def _plain_causal(mask: torch.Tensor) -> torch.Tensor | None:
    """None where a row's mask [1, 1, q, T] is the plain causal one (what the row's model call alone passes:
    no padding to note, sdpa's causal path), else the mask."""
    queries, total = mask.shape[-2:]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.arange(total, device=mask.device)[None, :] <= (total - queries + torch.arange(queries, device=mask.device))[:, None]
    return None if bool((allowed == causal).all()) else mask


class RowSplit:
    """The engines of a left-padded batch's rows (see the module docstring); ``pads[i]`` is row ``i``'s
    padding, which every row's logical length counts and its engine does not store."""

    def __init__(self, parent: Any, pads: list[int], make: Callable[[], Any]) -> None:
        """``parent``: the batch's engine (its rotary module and token tap are shared); ``make()`` a new
        empty engine of the same pipeline and shape."""
        self.pads = pads
        self.engines: list[Any] = []
        for _ in pads:
            engine = make()
            engine.rotary = parent.rotary
            engine.observer.boundary_ids = parent.observer.boundary_ids
            engine.observer.tap = TokenTap() if parent.observer.tap is not None else None  # the row's ids, set per forward
            self.engines.append(engine)
        self.token_tap = parent.observer.tap
        #: per layer, the logical tokens (padding included) the batch has sent
        self.logical = [0] * parent.shape.num_layers
        #: per layer, what each row's engine returned in the forward in progress (for the attention)
        self.returned: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.assembled: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------------------- update
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, materialize: bool) -> tuple[torch.Tensor, torch.Tensor] | None:
        past = self.logical[layer]
        new = keys.shape[-2]
        self.logical[layer] += new
        if layer == 0 and self.token_tap is not None:
            ids = self.token_tap.pending
            for i, engine in enumerate(self.engines):
                engine.observer.tap.pending = None if ids is None else ids[i : i + 1, max(0, self.pads[i] - past):]  # type: ignore[union-attr]
            self.token_tap.pending = None
        outputs = []
        for i, engine in enumerate(self.engines):
            start = max(0, self.pads[i] - past)  # the row's padding among this forward's tokens
            if start >= new:
                raise CacheStateError(f"row {i} of the batch got only padding in a forward after its first; kvweave caches take left padding only")
            outputs.append(engine.update(layer, keys[i : i + 1, :, start:], values[i : i + 1, :, start:], materialize))
        if not materialize:
            return None
        self.returned[layer] = outputs  # type: ignore[assignment]
        longest = max(k.shape[-2] for k, _ in outputs)  # type: ignore[union-attr]
        batch, heads, _, dim = keys.shape
        full = []
        for kind in range(len(KINDS)):
            out = keys.new_zeros(batch, heads, longest, dim)
            for i, pair in enumerate(outputs):
                tensor = pair[kind]  # type: ignore[index]
                out[i, :, longest - tensor.shape[-2]:] = tensor[0]
            full.append(out)
        self.assembled[layer] = full[0]
        return full[0], full[1]

    def owns(self, layer: int, keys: torch.Tensor) -> bool:
        return self.assembled.get(layer) is keys

    def attend(self, attention: Any, module: Any, query: torch.Tensor, attention_mask: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        """``attention(engine, module, query, key, value, mask, **kwargs)`` row by row, each row over what its
        own engine returned and the last columns of the model's mask that cover its tokens."""
        layer = module.layer_idx
        pairs = self.returned.pop(layer)
        self.assembled.pop(layer, None)
        past = self.logical[layer] - query.shape[-2]
        outputs = []
        for i, (engine, (key, value)) in enumerate(zip(self.engines, pairs)):
            start = max(0, self.pads[i] - past)  # the row's padding queries are left out (their output is zero)
            mask = attention_mask
            if isinstance(mask, torch.Tensor) and mask.dim() == 4:
                mask = _plain_causal(mask[i : i + 1, :, start:, mask.shape[-1] - engine.seq_length(layer):])
            out = attention(engine, module, query[i : i + 1, :, start:], key, value, mask, **kwargs)
            out = out[0] if isinstance(out, tuple) else out  # [1, q - start, Hq, D]
            if start:
                out = torch.cat((out.new_zeros(1, start, *out.shape[2:]), out), dim=1)
            outputs.append(out)
        return torch.cat(outputs, dim=0), None

    # ------------------------------------------------------------------------------- state
    def seq_length(self, layer: int) -> int:
        return self.logical[layer]

    def memory_breakdown(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for engine in self.engines:
            for part, size in engine.memory_breakdown().items():
                total[part] = total.get(part, 0) + size
        return total

    def select(self, index: torch.Tensor) -> None:
        """Keep rows ``index`` (reordering and repeats allowed: a repeated row's engine is copied)."""
        seen: set[int] = set()
        engines, pads = [], []
        for row in index.tolist():
            engine = self.engines[row]
            if row in seen:  # a copy of its own, sharing only the pipeline and the model's rotary module
                keep = {id(engine.pipeline): engine.pipeline, id(engine.rotary): engine.rotary}
                engine = copy.deepcopy(engine, memo=keep)
            engines.append(engine)
            pads.append(self.pads[row])
            seen.add(row)
        self.engines, self.pads = engines, pads
        self.returned, self.assembled = {}, {}
