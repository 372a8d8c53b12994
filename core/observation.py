"""What the cache observes of the model beyond K/V: the most recent queries of each layer (for the
router's attention features and the probe) and which tokens are delimiters (from the token ids).

Queries reach the cache through the ``kvweave-observe`` attention implementation (sdpa, plus a note of
the last ``observe_queries`` queries per layer); token ids through a forward pre-hook on the model's
input embeddings. Both are installed by :func:`bind_model`. Everything kept here counts in the cache's
bytes ("observation").
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

from .errors import CacheStateError
from .interfaces import ModelShape
from .storage import tensor_bytes

ATTENTION_NAME = "kvweave-observe"
_active = threading.local()


def set_active(engine: Any) -> None:
    """Called by each cache layer's update: the attention call that follows belongs to ``engine``."""
    _active.engine = weakref.ref(engine)


def _observing_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ref = getattr(_active, "engine", None)
    engine = ref() if ref is not None else None
    if engine is None or not engine.observer.active or not engine.owns(module.layer_idx, key):
        # another cache (or none) serves this forward: plain sdpa, nothing recorded
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    engine.observer.record(module.layer_idx, query, kwargs.get("scaling") or getattr(module, "scaling", None))
    output = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    engine.after_attention(module.layer_idx)
    return output


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _observing_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


class TokenTap:
    """Holds the token ids of the forward pass in progress (set by an embedding pre-hook)."""

    def __init__(self) -> None:
        self.pending: torch.Tensor | None = None

    def __call__(self, module: Any, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].dtype in (torch.long, torch.int):
            self.pending = args[0]


def bind_model(model: Any, engine: Any, tokenizer: Any = None) -> None:
    """Let ``engine`` observe ``model``: switch its attention to ``kvweave-observe`` when the pipeline needs
    queries, and tap its token ids when the router needs delimiter flags (which need ``tokenizer``)."""
    observer = engine.observer
    if observer.active and model.config._attn_implementation != ATTENTION_NAME:
        _register_attention()
        model.set_attn_implementation(ATTENTION_NAME)
    if engine.router.needs_boundaries:
        if tokenizer is None:
            raise CacheStateError(
                f"pipeline '{engine.pipeline.name}': router '{engine.pipeline.slots['router'].use}' uses delimiter "
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


class Observer:
    """Recent queries per layer and delimiter flags of the tokens not yet compressed everywhere."""

    def __init__(self, shape: ModelShape, queries: int) -> None:
        self.shape = shape
        self.keep = queries
        self.tap: TokenTap | None = None
        self.boundary_ids: torch.Tensor | None = None
        self.reset()

    @property
    def active(self) -> bool:
        return self.keep > 0

    def reset(self) -> None:
        self._queries: list[torch.Tensor | None] = [None] * self.shape.num_layers
        self.scaling: float | None = None
        self._flags: torch.Tensor | None = None  # [B, tokens since _flag_start]
        self._flag_start = 0

    def start_forward(self, tokens: int) -> None:
        if self.tap is None:
            return
        ids = self.tap.pending
        if ids is None or ids.shape[-1] != tokens:
            raise CacheStateError(
                f"the cache received {tokens} new tokens but the model's token ids were not seen (or did not "
                "match); call the model with input_ids, not inputs_embeds, when the router uses delimiter flags"
            )
        flags = torch.isin(ids, self.boundary_ids.to(ids.device)).to(torch.uint8)
        self._flags = flags if self._flags is None else torch.cat((self._flags, flags), dim=-1)
        self.tap.pending = None

    def record(self, layer: int, query: torch.Tensor, scaling: float | None) -> None:
        """Keep the last ``keep`` queries [B, Hq, q, D] of ``layer``."""
        old = self._queries[layer]
        recent = query[..., -self.keep :, :].detach()
        joined = recent if old is None else torch.cat((old, recent), dim=-2)[..., -self.keep :, :]
        self._queries[layer] = joined.contiguous().clone()  # never a view of the whole query tensor
        self.scaling = scaling

    def queries(self, layer: int) -> torch.Tensor:
        return self._queries[layer]  # type: ignore[return-value]

    def attention_stats(self, layer: int, keys: torch.Tensor, block: int, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed and largest attention probability of the recent queries on keys ``first .. first+block``.

        ``keys`` [B, H, T, D] all keys of ``layer``; returns two [B, H, block] tensors."""
        queries = self._queries[layer].float()
        batch, q_heads, observed, dim = queries.shape
        heads = keys.shape[1]
        grouped = queries.reshape(batch, heads, q_heads // heads * observed, dim)
        scale = self.scaling or dim**-0.5
        logits = grouped @ keys.float().transpose(-1, -2) * scale  # [B, H, (Hq/H) * o, T]
        total = keys.shape[-2]
        query_pos = (total - observed + torch.arange(observed, device=keys.device)).repeat(q_heads // heads)
        key_pos = torch.arange(total, device=keys.device)
        logits = logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))
        probs = logits.softmax(dim=-1)[..., first : first + block]
        return probs.sum(dim=-2), probs.amax(dim=-2)

    def boundaries(self, first: int, block: int) -> torch.Tensor | None:
        """Delimiter flags [B, block] of logical tokens ``first .. first+block``."""
        if self._flags is None:
            return None
        start = first - self._flag_start
        return self._flags[:, start : start + block].float()

    def forget_boundaries(self, upto: int) -> None:
        """Drop flags of tokens every layer has compressed."""
        if self._flags is not None and upto > self._flag_start:
            self._flags = self._flags[:, upto - self._flag_start :].clone()
            self._flag_start = upto

    def nbytes(self) -> int:
        tensors = [q for q in self._queries if q is not None]
        if self._flags is not None:
            tensors.append(self._flags)
        return tensor_bytes(tensors)

    def select_batch(self, index: torch.Tensor) -> None:
        self._queries = [None if q is None else q.index_select(0, index.to(q.device)) for q in self._queries]
        if self._flags is not None:
            self._flags = self._flags.index_select(0, index.to(self._flags.device))
