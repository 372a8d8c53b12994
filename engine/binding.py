"""How a cache binds to its model: the hooks that hand the engine what the model's forward holds beyond K/V (the token
ids for the delimiter features, the 2-D attention mask for a left-padded batch) and the switch of the model's attention
to ``kvweave-observe`` (:mod:`kvweave.engine.observation`), and the delimiter tokens of a tokenizer."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.core.errors import CacheStateError
from kvweave.engine.observation import ATTENTION_NAME, register_attention


class TokenTap:
    """Holds the token ids of the forward pass in progress (set by an embedding pre-hook)."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def __call__(self, module: Any, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.long, torch.int):
            self.pending = args[0]


class MaskTap:
    """Holds the 2-D attention mask of the model's forward in progress (a forward pre-hook on the model)."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def __call__(self, module: Any, args: tuple, kwargs: dict) -> None:
        mask = kwargs.get("attention_mask")
        self.pending = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


def bind_model(model: Any, engine: Any, tokenizer: Any = None) -> None:
    """Let ``engine`` observe ``model``: switch its attention to ``kvweave-observe`` when the pipeline needs
    queries, and tap its token ids when the router needs delimiter flags (which need ``tokenizer``)."""
    observer = engine.observer
    if engine.settings.compress:  # a left-padded batch gets per-row storage (engine/rows.py)
        mask_tap = getattr(model, "_kvweave_mask_tap", None)
        if mask_tap is None:
            mask_tap = MaskTap()
            model.register_forward_pre_hook(mask_tap, with_kwargs=True)
            model._kvweave_mask_tap = mask_tap
        engine.mask_tap = mask_tap
    if engine.own_attention and model.config._attn_implementation != ATTENTION_NAME:
        register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
    if engine.router.needs_boundaries or getattr(engine.probe, "needs_boundaries", False):
        if tokenizer is None:
            slot = "router" if engine.router.needs_boundaries else "probe"
            raise CacheStateError(
                f"pipeline '{engine.pipeline.name}': {slot} '{engine.pipeline.slots[slot].use}' uses delimiter "
                "features from the token ids; pass tokenizer= to build_cache"
            )
        tap = getattr(model, "_kvweave_token_tap", None)
        if tap is None:
            tap = TokenTap()
            model.get_input_embeddings().register_forward_pre_hook(tap)
            model._kvweave_token_tap = tap
        observer.tap = tap
        observer.boundary_ids = boundary_token_ids(tokenizer)


_BOUNDARY_CACHE: dict[tuple[str, int], torch.Tensor] = {}
BOUNDARY_CHARACTERS = set("\n.:;?!")


def boundary_token_ids(tokenizer: Any) -> torch.Tensor:
    """Ids of tokens that contain a delimiter character, and the tokenizer's special tokens."""
    key = (str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)), len(tokenizer))
    if key not in _BOUNDARY_CACHE:
        ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocabulary = range(len(tokenizer))
        batch_decode = getattr(tokenizer, "batch_decode", None)
        texts = batch_decode([[i] for i in vocabulary]) if batch_decode else [tokenizer.decode([i]) for i in vocabulary]
        ids.update(i for i, text in zip(vocabulary, texts) if BOUNDARY_CHARACTERS & set(text))
        _BOUNDARY_CACHE[key] = torch.tensor(sorted(ids), dtype=torch.long)
    return _BOUNDARY_CACHE[key]
