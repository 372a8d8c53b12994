"""Run ``model.generate`` with a kvweave cache and measure what it stored.

transformers renamed the cache argument from ``past_key_values`` (5.17) to ``cache`` (5.24, where the
old name warns); :func:`cache_kwargs` picks the name the installed version expects.
"""

from __future__ import annotations

import inspect
import time
from typing import Any

import attrs
import torch

from kvweave.engine.cache import KVWeaveCache


def cache_argument_name(model: Any) -> str:
    """``"cache"`` where the model's forward takes it (transformers >= 5.24), else ``"past_key_values"``."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model.generate(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_argument_name(model): cache}


@attrs.frozen
class GenerationStats:
    """What one generation stored and how long it took."""

    pipeline: str
    batch_size: int
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    stored_bytes: int
    full_16bit_bytes: int
    prefill_seconds: float
    decode_seconds: float
    breakdown: dict[str, int]
    #: bytes a full cache of the same tokens holds in the model's own compute dtype (4 bytes a value in float32)
    full_model_dtype_bytes: int = 0
    model_dtype: str = "bfloat16"

    @property
    def ratio(self) -> float:
        """Stored bytes against a 16-bit full cache of the same tokens."""
        return self.full_16bit_bytes / self.stored_bytes if self.stored_bytes else float("nan")

    @property
    def ratio_model_dtype(self) -> float:
        """Stored bytes against the full cache the model itself would keep, in its compute dtype."""
        return self.full_model_dtype_bytes / self.stored_bytes if self.stored_bytes else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.generated_tokens - 1  # the first new token comes out of prefill
        return steps * self.batch_size / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else float("nan")

    def to_dict(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data["ratio"] = self.ratio
        data["ratio_model_dtype"] = self.ratio_model_dtype
        data["decode_tokens_per_second"] = self.decode_tokens_per_second
        return data


class _PrefillTimer:
    """A logits processor that notes when the first token's logits are ready (end of prefill)."""

    def __init__(self) -> None:
        self.first_token_at: float | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_token_at is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            self.first_token_at = time.perf_counter()
        return scores


def _element_size(model: Any) -> int:
    """Bytes of one value in the model's compute dtype (2 when it has none, e.g. a bare config)."""
    dtype = getattr(model, "dtype", None)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2


def generate(
    model: Any, inputs: dict[str, torch.Tensor], cache: KVWeaveCache, **generate_kwargs: Any
) -> tuple[torch.Tensor, GenerationStats]:
    """``model.generate`` with ``cache``; returns the new token ids [B, new] and the stats."""
    from transformers import LogitsProcessorList

    timer = _PrefillTimer()
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", []) or [])
    processors.append(timer)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(**inputs, logits_processor=processors, **cache_kwargs(model, cache), **generate_kwargs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    prompt_tokens = inputs["input_ids"].shape[1]
    new_tokens = output[:, prompt_tokens:]
    first = timer.first_token_at or end
    stats = GenerationStats(
        pipeline=cache.pipeline.name,
        batch_size=int(output.shape[0]),
        prompt_tokens=int(prompt_tokens),
        generated_tokens=int(new_tokens.shape[1]),
        cached_tokens=cache.get_seq_length(),
        stored_bytes=cache.memory_bytes(),
        full_16bit_bytes=cache.full_cache_bytes_16bit(),
        prefill_seconds=first - start,
        decode_seconds=end - first,
        breakdown=cache.memory_breakdown(),
        full_model_dtype_bytes=cache.full_cache_bytes_16bit() * _element_size(model) // 2,
        model_dtype=str(getattr(model, "dtype", torch.bfloat16)).replace("torch.", ""),
    )
    return new_tokens, stats
