"""``KVWeaveCache``: a ``transformers.Cache`` whose layers hold only the packed tensors of a pipeline.

Use it like any cache::

    cache = KVWeaveCache(pipeline, model.config)
    model.generate(**inputs, **cache_kwargs(model, cache))   # past_key_values= or cache=, by version
    cache.memory_bytes()                                     # real bytes stored, metadata included

Each model layer gets a :class:`KVWeaveLayer` that forwards to one shared
:class:`~kvweave.engine.engine.CompressionEngine` (so layers of a basis group can be encoded together).

Under tensor parallelism each rank's cache holds that rank's KV heads only (``shard``, see
:mod:`kvweave.engine.sharding`): ``shape`` is the rank's share, ``model_shape`` the whole model, the byte
counts are the rank's own, and :meth:`KVWeaveCache.gathered_memory` sums them over the ranks.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvweave.engine.engine import CompressionEngine
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.engine.binding import bind_model
from kvweave.engine.observation import set_active
from kvweave.engine.rotary import RotaryInverse
from kvweave.core.registry import ResolvedPipeline
from kvweave.engine.sharding import HeadShard, check_shardable, gather_counts

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def model_shape(config: Any) -> ModelShape:
    """Read the attention shape of a decoder-only model from its (text) config."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        num_layers = int(config.num_hidden_layers)
        num_heads = int(config.num_attention_heads)
    except AttributeError as exc:
        raise ModelError(
            f"model config of type {type(config).__name__} has no num_hidden_layers/num_attention_heads; "
            "kvweave compresses decoder-only attention models"
        ) from exc
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(config, "head_dim", None) or int(config.hidden_size) // num_heads
    layer_types = tuple(getattr(config, "layer_types", None) or ())
    unsupported = sorted({kind for kind in layer_types if kind not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ModelError(
            f"model type '{getattr(config, 'model_type', '?')}' has layers of type {unsupported}; kvweave caches "
            f"only {', '.join(SUPPORTED_LAYER_TYPES)} layers"
        )
    if getattr(config, "kv_sharing_modes", None):
        raise ModelError("models whose layers reuse another layer's KV cache (kv_sharing_modes) are not supported")
    return ModelShape(
        num_layers, num_heads, num_kv_heads, int(head_dim), str(getattr(config, "model_type", "unknown")),
        layer_windows=_layer_windows(config, layer_types, num_layers),
    )


def _layer_windows(config: Any, layer_types: tuple[str, ...], num_layers: int) -> tuple[int, ...]:
    """Per layer, the sliding window (0: full attention), as transformers' own cache reads the config: the
    ``layer_types`` where given, else every layer slides when the config sets a ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if not layer_types:
        layer_types = ("sliding_attention" if window is not None else "full_attention",) * num_layers
    if "sliding_attention" not in layer_types:
        return ()
    if len(layer_types) != num_layers:
        raise ModelError(f"the model config lists {len(layer_types)} layer_types for {num_layers} layers")
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ModelError(
            f"model type '{getattr(config, 'model_type', '?')}' has sliding-window layers but its config's "
            f"sliding_window is {window!r}; kvweave needs the window (a whole number of tokens >= 2)"
        )
    return tuple(window if kind == "sliding_attention" else 0 for kind in layer_types)


class KVWeaveLayer(CacheLayerMixin):
    """One model layer's view of the shared engine. Holds no tensors itself."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, engine: CompressionEngine, layer_idx: int) -> None:
        super().__init__()
        self.engine = engine
        self.layer_idx = layer_idx
        #: a sliding-window layer keeps its last ``window - 1`` tokens exactly, as the model's own cache does
        self.is_sliding = layer_idx in engine.sliding

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        set_active(self.engine)
        return self.engine.update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.engine.seq_length(self.layer_idx)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.is_sliding:  # the tokens it holds start after the ones that left its window
            window = self.engine.windows[self.layer_idx]
            return window.compressed_tokens + window.exact_tokens + query_length, window.dropped_tokens
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    # The engine holds the data: the per-layer hooks below act on all layers at once, from the cache.
    def reset(self) -> None:
        self.is_initialized = False

    def offload(self) -> None:
        raise CacheStateError("KVWeaveCache does not support offloading; its packed cache already stays small")

    def prefetch(self) -> None:
        return None


@attrs.frozen
class GatheredMemory:
    """Stored bytes summed over the ranks that share a model's heads (one rank: its own), with each
    rank's own bytes in rank order."""

    stored_bytes: int
    full_16bit_bytes: int
    breakdown: dict[str, int]
    rank_bytes: tuple[int, ...]


class KVWeaveCache(Cache):
    """A compressed KV cache assembled from a resolved pipeline, for one model (or, with ``shard``, for
    the KV heads one tensor-parallel rank of it computes)."""

    def __init__(self, pipeline: ResolvedPipeline, config: Any, shard: HeadShard | None = None) -> None:
        #: the whole model's attention shape; ``shape`` is what this cache stores (a rank's share of the heads)
        self.model_shape = model_shape(config)
        self.shard = shard
        #: per slot, how its component works on a share of the heads ('head-local' or 'rank-budget')
        self.sharding: dict[str, str] = check_shardable(pipeline, shard) if shard is not None else {}
        self.shape = shard.local_shape(self.model_shape) if shard is not None else self.model_shape
        self.pipeline = pipeline
        self.engine = CompressionEngine(pipeline, self.shape)
        self.tokenizer: Any = None
        super().__init__(layers=[KVWeaveLayer(self.engine, i) for i in range(self.shape.num_layers)])

    def bind(self, model: Any, tokenizer: Any = None) -> KVWeaveCache:
        """Let the cache observe ``model`` where its router or probe needs queries or token ids."""
        bind_model(model, self.engine, tokenizer)
        self.tokenizer = tokenizer  # context scoring (engine/importance.py) builds its repeat prompt with it
        if self.engine.evicts and self.engine.evictor.needs_importance and tokenizer is None:
            raise CacheStateError(
                f"pipeline '{self.pipeline.name}': evictor '{self.pipeline.use('evictor')}' scores the context by asking the "
                "model to repeat it, which needs the tokenizer; pass tokenizer= to build_cache")
        if self.engine.pre_rope:
            where = f"pipeline '{self.pipeline.name}', setting key_space"
            self.engine.rotary = RotaryInverse.from_model(model, self.engine.shape.head_dim, where)
        return self

    def set_importance(self, scores: torch.Tensor) -> None:
        """Context importance [L, B, H, T] of the tokens the next (first) forward feeds, for an evictor that
        chooses by it (``kvweave.engine.importance.prefill`` computes and sets it)."""
        if self.shard is not None:
            raise CacheStateError(f"pipeline '{self.pipeline.name}': context importance is not split over tensor-parallel ranks")
        self.engine.eviction.context.set(scores)

    def __repr__(self) -> str:
        return f"KVWeaveCache(pipeline={self.pipeline.name!r}, tokens={self.get_seq_length()}, bytes={self.memory_bytes()})"

    # ------------------------------------------------------------------ memory accounting
    def memory_bytes(self) -> int:
        """Real bytes stored: the ``nbytes`` of every packed tensor, window, scale, index and basis."""
        return self.engine.memory_bytes()

    def memory_breakdown(self) -> dict[str, int]:
        return self.engine.memory_breakdown()

    def full_cache_bytes_16bit(self) -> int:
        """What the model's own cache would hold in 16 bits for the same tokens and batch: every token of a
        full-attention layer, the last ``window - 1`` of a sliding-window layer."""
        return self.shape.own_cache_bytes_16bit(self.get_seq_length(), max(self.engine.batch_size(), 0))

    def gathered_memory(self) -> GatheredMemory:
        """This cache's bytes summed over the ranks of its shard: one all-gather, so every rank must call it
        (at stats time; nothing is communicated while decoding). Unsharded: this cache's own bytes."""
        breakdown = self.memory_breakdown()
        every = gather_counts([self.memory_bytes(), self.full_cache_bytes_16bit(), *breakdown.values()], self.shard)
        return GatheredMemory(
            stored_bytes=sum(rank[0] for rank in every),
            full_16bit_bytes=sum(rank[1] for rank in every),
            breakdown={part: sum(rank[2 + i] for rank in every) for i, part in enumerate(breakdown)},
            rank_bytes=tuple(rank[0] for rank in every),
        )

    def settle(self) -> None:
        """Raise now for a decode step's token beyond an int8 window's range whose check is still on its way to the host
        (one wait; a later append or flush would raise it, but the last steps of a generation have neither):
        :func:`kvweave.engine.generation.generate` calls it after decoding."""
        rows = self.engine.rows
        for engine in [self.engine, *(rows.engines if rows is not None else [])]:
            for window in engine.windows:
                window.exact.settle()

    def compression_ratio(self) -> float:
        stored = self.memory_bytes()
        return self.full_cache_bytes_16bit() / stored if stored else float("nan")

    # ------------------------------------------------------------------ batch operations
    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.engine.select_batch(torch.as_tensor(beam_idx).long().cpu())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.engine.select_batch(torch.as_tensor(indices).long().cpu())

    def batch_repeat_interleave(self, repeats: int) -> None:
        batch = self.engine.batch_size()
        if batch > 0:
            self.engine.select_batch(torch.arange(batch).repeat_interleave(repeats))

    def reset(self) -> None:
        self.engine.reset()
        for layer in self.layers:
            layer.reset()

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove == 0:
            return
        raise CacheStateError(
            f"KVWeaveCache cannot crop {tokens_to_remove} tokens: compressed blocks cannot be un-appended "
            "(assisted or speculative decoding needs a croppable cache such as DynamicCache)"
        )

    @property
    def batch_size(self) -> int:
        return self.engine.batch_size()
