"""``KVWeaveCache``: a ``transformers.Cache`` whose layers hold only the packed tensors of a pipeline.

Use it like any cache::

    cache = KVWeaveCache(pipeline, model.config)
    model.generate(**inputs, **cache_kwargs(model, cache))   # past_key_values= or cache=, by version
    cache.memory_bytes()                                     # real bytes stored, metadata included

Each model layer gets a :class:`KVWeaveLayer` that forwards to one shared
:class:`~kvweave.engine.engine.CompressionEngine` (so layers of a basis group can be encoded together).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvweave.engine.engine import CompressionEngine
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.engine.observation import bind_model, set_active
from kvweave.engine.rotary import RotaryInverse
from kvweave.core.registry import ResolvedPipeline

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
    return ModelShape(num_layers, num_heads, num_kv_heads, int(head_dim), str(getattr(config, "model_type", "unknown")))


class KVWeaveLayer(CacheLayerMixin):
    """One model layer's view of the shared engine. Holds no tensors itself."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, engine: CompressionEngine, layer_idx: int) -> None:
        super().__init__()
        self.engine = engine
        self.layer_idx = layer_idx

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


class KVWeaveCache(Cache):
    """A compressed KV cache assembled from a resolved pipeline, for one model."""

    def __init__(self, pipeline: ResolvedPipeline, config: Any) -> None:
        self.shape = model_shape(config)
        self.pipeline = pipeline
        self.engine = CompressionEngine(pipeline, self.shape)
        super().__init__(layers=[KVWeaveLayer(self.engine, i) for i in range(self.shape.num_layers)])

    def bind(self, model: Any, tokenizer: Any = None) -> KVWeaveCache:
        """Let the cache observe ``model`` where its router or probe needs queries or token ids."""
        bind_model(model, self.engine, tokenizer)
        if self.engine.pre_rope:
            where = f"pipeline '{self.pipeline.name}', setting key_space"
            self.engine.rotary = RotaryInverse.from_model(model, self.engine.shape.head_dim, where)
        return self

    def __repr__(self) -> str:
        return f"KVWeaveCache(pipeline={self.pipeline.name!r}, tokens={self.get_seq_length()}, bytes={self.memory_bytes()})"

    # ------------------------------------------------------------------ memory accounting
    def memory_bytes(self) -> int:
        """Real bytes stored: the ``nbytes`` of every packed tensor, window, scale, index and basis."""
        return self.engine.memory_bytes()

    def memory_breakdown(self) -> dict[str, int]:
        return self.engine.memory_breakdown()

    def full_cache_bytes_16bit(self) -> int:
        """What a 16-bit full cache would hold for the same tokens and batch."""
        batch = max(self.engine.batch_size(), 0)
        return batch * self.get_seq_length() * self.shape.kv_bytes_per_token_16bit

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
