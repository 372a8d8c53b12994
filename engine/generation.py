"""Run ``model.generate`` with a kvweave cache and measure what it stored.

A long prompt's prefill can take a minute on a CPU; :func:`generate` can show it as a progress bar on
stderr that advances as each decoder layer finishes the prompt (``prefill_progress``, or
:func:`show_prefill_progress` around the call). The bar only watches the one prefill forward: the
prompt is not split, so every pipeline stores and generates exactly what it does without the bar (a
compressing cache packs the tokens of each forward after it, so feeding the prompt in chunks would change
what later chunks attend to).

transformers renamed the cache argument from ``past_key_values`` (5.17) to ``cache`` (5.24, where the
old name warns); :func:`cache_kwargs` picks the name the installed version expects.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import time
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from kvweave.core.errors import CacheStateError
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.graphs import ended_rows_padded, graph_decode, graph_refusal
from kvweave.engine.importance import score_for, score_whole
from kvweave.engine.observation import cache_argument_name, cache_kwargs  # noqa: F401 (tools import them from here)


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
    #: under tensor parallelism each rank's own stored bytes, in rank order (the sum is ``stored_bytes``); () otherwise
    rank_bytes: tuple[int, ...] = ()
    #: the part of ``prefill_seconds`` spent scoring the context and storing it from the scoring's pass (an evictor that
    #: chooses by context importance, KVzip's; ~0 for the other pipelines)
    scoring_seconds: float = 0.0

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
        self.on_first_token: Any = None  # called once the first token's logits are ready (after the time is taken)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.first_token_at is None:
            if scores.is_cuda:
                torch.cuda.synchronize(scores.device)
            self.first_token_at = time.perf_counter()
            if self.on_first_token is not None:
                self.on_first_token()
        return scores


#: prompts of at least this many tokens get a prefill progress bar under :func:`show_prefill_progress`
PREFILL_PROGRESS_TOKENS = 1000
_prefill_progress: contextvars.ContextVar[int | None] = contextvars.ContextVar("kvweave_prefill_progress", default=None)


@contextlib.contextmanager
def show_prefill_progress(min_tokens: int | None = None) -> Iterator[None]:
    """Within the block, :func:`generate` shows a prefill progress bar on stderr for prompts of at least
    ``min_tokens`` tokens (default :data:`PREFILL_PROGRESS_TOKENS`, read when the block starts)."""
    token = _prefill_progress.set(PREFILL_PROGRESS_TOKENS if min_tokens is None else min_tokens)
    try:
        yield
    finally:
        _prefill_progress.reset(token)


def decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers in order (``model.model.layers`` for Llama-like models; else the first
    ModuleList as long as the config's ``num_hidden_layers``), or [] when they cannot be told apart."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    count = getattr(config, "num_hidden_layers", None)
    inner = getattr(getattr(model, "model", None), "layers", None)
    if isinstance(inner, torch.nn.ModuleList) and len(inner) > 0 and count in (None, len(inner)):
        return list(inner)
    if not isinstance(count, int) or count < 1 or not isinstance(model, torch.nn.Module):
        return []
    return next((list(m) for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == count), [])


class _PrefillProgress:
    """A tqdm bar on stderr, one step per decoder layer of the first forward (the prefill); where the layers
    cannot be found, one line ``prefilling N tokens...`` and, when it ends, the seconds it took."""

    def __init__(self, model: Any, tokens: int) -> None:
        self.tokens = tokens
        self.layers = decoder_layers(model)
        self.cuda = any(p.is_cuda for p in self.layers[0].parameters()) if self.layers else False
        self.hooks: list[Any] = []
        self.bar: Any = None
        self.done = False
        self.start = time.perf_counter()

    def __enter__(self) -> _PrefillProgress:
        if not self.layers:
            print(f"kvweave: prefilling {self.tokens:,} tokens...", file=sys.stderr, flush=True)
            return self
        from tqdm.auto import tqdm

        self.bar = tqdm(total=len(self.layers), desc=f"prefill {self.tokens:,} tokens", unit="layer", file=sys.stderr,
                        dynamic_ncols=True)
        self.hooks = [layer.register_forward_hook(self._layer_done) for layer in self.layers]
        return self

    def _layer_done(self, module: Any, *_: Any) -> None:
        if self.bar is not None:
            if self.cuda:  # kernels run asynchronously: count a layer when its work is done, not queued
                torch.cuda.synchronize()
            self.bar.update(1)
            if self.bar.n >= self.bar.total:  # the prefill has gone through every layer; decode steps are not counted
                self.bar.close()
                self.bar = None

    def prefilled(self) -> None:
        """The first token's logits are ready: end the bar (or say how long the prefill took)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif not self.layers and not self.done:
            print(f"kvweave: prefilled {self.tokens:,} tokens in {time.perf_counter() - self.start:.1f} s", file=sys.stderr, flush=True)
        self.done = True

    def __exit__(self, *_: Any) -> None:
        for hook in self.hooks:
            hook.remove()
        if self.bar is not None:  # generation failed or was interrupted mid-prefill
            self.bar.close()
            self.bar = None


def _element_size(model: Any) -> int:
    """Bytes of one value in the model's compute dtype (2 when it has none, e.g. a bare config)."""
    dtype = getattr(model, "dtype", None)
    return torch.empty((), dtype=dtype).element_size() if isinstance(dtype, torch.dtype) else 2


def generate(
    model: Any, inputs: dict[str, torch.Tensor], cache: KVWeaveCache, *, prefill_progress: int | None = None,
    cuda_graphs: bool = False, **generate_kwargs: Any,
) -> tuple[torch.Tensor, GenerationStats]:
    """``model.generate`` with ``cache``; returns the new token ids [B, new] and the stats.

    ``prefill_progress=N``: a prompt of at least N tokens shows a progress bar on stderr while it is
    prefilled, one step per decoder layer (default: what :func:`show_prefill_progress` set, else none).
    The bar changes nothing the model computes. ``cuda_graphs``: greedy decoding after the first token with each
    block's steps replayed from a CUDA graph (:mod:`kvweave.engine.graphs`; the same tokens), refused before the
    prefill where the cache or the options cannot have it."""
    from transformers import LogitsProcessorList

    max_new = generate_kwargs.get("max_new_tokens")
    if cuda_graphs:
        refuse_graphs(cache, inputs, generate_kwargs)
    # a cache that scores its prompt and can store all of it: the first token from the scoring pass's logits, where
    # the options leave it the greedy argmax (first_token_refusal), so no forward of the prompt's last token follows
    plain = first_token_refusal(model, inputs, generate_kwargs) is None
    if cuda_graphs:
        generate_kwargs["max_new_tokens"] = 1  # the prompt and the first token; the steps after it from the graphs

    timer = _PrefillTimer()
    processors = LogitsProcessorList(generate_kwargs.pop("logits_processor", []) or [])
    processors.append(timer)
    threshold = _prefill_progress.get() if prefill_progress is None else prefill_progress
    prompt_tokens = inputs["input_ids"].shape[1]
    progress = _PrefillProgress(model, int(prompt_tokens)) if threshold is not None and prompt_tokens >= threshold else None
    if progress is not None:
        timer.on_first_token = progress.prefilled
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    # evictors by importance: the context scored, and stored from the scoring's own pass where the cache allows it
    logits = None
    if plain:
        logits = score_whole(model, cache, inputs["input_ids"], progress is not None, inputs.get("attention_mask"))
    else:
        score_for(model, cache, inputs["input_ids"], progress is not None, inputs.get("attention_mask"), ingest=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    scored = time.perf_counter()
    config = model.generation_config
    eos, pad = (generate_kwargs.get(name, getattr(config, name)) for name in ("eos_token_id", "pad_token_id"))
    with torch.inference_mode(), progress or contextlib.nullcontext():
        if logits is not None:
            output, first_at = _after_first_token(model, inputs, cache, logits, processors, max_new, eos, pad, cuda_graphs,
                                                  generate_kwargs, progress)
        else:
            output = model.generate(**inputs, logits_processor=processors, **cache_kwargs(model, cache), **generate_kwargs)
            if cuda_graphs:
                output = torch.cat((output, _graph_steps(model, cache, output[:, prompt_tokens:], max_new - 1, eos, pad)), dim=1)
            first_at = None
    cache.settle()  # the last steps' int8 window range checks, which no later append or flush would raise
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    end = time.perf_counter()
    new_tokens = output[:, prompt_tokens:]
    first = first_at or timer.first_token_at or end
    memory = cache.gathered_memory()  # summed over tensor-parallel ranks: one all-gather, after decoding
    stats = GenerationStats(
        pipeline=cache.pipeline.name,
        batch_size=int(output.shape[0]),
        prompt_tokens=int(prompt_tokens),
        generated_tokens=int(new_tokens.shape[1]),
        cached_tokens=cache.get_seq_length(),
        stored_bytes=memory.stored_bytes,
        full_16bit_bytes=memory.full_16bit_bytes,
        prefill_seconds=first - start,
        decode_seconds=end - first,
        breakdown=memory.breakdown,
        full_model_dtype_bytes=memory.full_16bit_bytes * _element_size(model) // 2,
        model_dtype=str(getattr(model, "dtype", torch.bfloat16)).replace("torch.", ""),
        rank_bytes=memory.rank_bytes if cache.shard is not None else (),
        scoring_seconds=scored - start,
    )
    return new_tokens, stats


#: generation options and generation-config fields that leave greedy decoding's first token the argmax of the
#: prompt's last logits (sampling fields are read only when sampling)
PLAIN_GREEDY = frozenset({
    "max_new_tokens", "do_sample", "num_beams", "eos_token_id", "pad_token_id", "bos_token_id", "decoder_start_token_id",
    "temperature", "top_p", "top_k", "min_p", "typical_p", "use_cache", "transformers_version", "cache_implementation",
    "_from_model_config",
})


def first_token_refusal(model: Any, inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> str | None:
    """Why :func:`generate` cannot take the first token as the argmax of the scoring pass's last logits (None: it can):
    sampling or beams, a logits processor, stopping criteria or streamer of the caller's, a generation setting that
    changes the first token's logits (a repetition penalty, a minimum length, forced or suppressed tokens, ...), inputs
    other than ``input_ids`` and an ``attention_mask``, or no ``max_new_tokens`` of at least 1. Then the prompt's last
    token is fed by ``model.generate`` as before, which applies them."""
    config = getattr(model, "generation_config", None)
    settings = {**(config.to_diff_dict() if config is not None else {}), **options}
    if settings.get("do_sample") or settings.get("num_beams", 1) not in (None, 1):
        return "sampling or beams"
    other = sorted(name for name, value in settings.items() if name not in PLAIN_GREEDY and value not in (None, False, [], {}))
    if other:
        return f"generation settings {other}"
    if set(inputs) - {"input_ids", "attention_mask"}:
        return f"inputs {sorted(set(inputs) - {'input_ids', 'attention_mask'})}"
    if not isinstance(options.get("max_new_tokens"), int) or options["max_new_tokens"] < 1:
        return "no max_new_tokens of at least 1"
    return None


def _after_first_token(model: Any, inputs: dict[str, torch.Tensor], cache: KVWeaveCache, logits: torch.Tensor,
                       processors: Any, max_new: int, eos: Any, pad: int | None, cuda_graphs: bool,
                       options: dict[str, Any], progress: Any) -> tuple[torch.Tensor, float]:
    """The prompt and its new tokens as ``model.generate`` returns them, the first one the argmax of ``logits`` [B, V]
    (the cache holds the whole prompt), the rest decoded after it; and when the first was ready."""
    first = logits.float().argmax(-1, keepdim=True).to(inputs["input_ids"].device)  # [B, 1], as greedy search takes it
    if first.is_cuda:
        torch.cuda.synchronize(first.device)
    first_at = time.perf_counter()
    if progress is not None:
        progress.prefilled()
    ids = inputs["input_ids"]
    ends = torch.tensor([] if eos is None else eos, device=first.device).reshape(-1)
    if max_new <= 1 or bool(torch.isin(first, ends).all()):
        return torch.cat((ids, first), dim=1), first_at
    if cuda_graphs:
        rest = _graph_steps(model, cache, first, max_new - 1, eos, pad)
    else:
        mask = inputs.get("attention_mask")
        fed = {"input_ids": torch.cat((ids, first), dim=1)}
        if mask is not None:
            fed["attention_mask"] = torch.cat((mask, torch.ones_like(first, dtype=mask.dtype)), dim=1)
        out = model.generate(**fed, logits_processor=processors, **cache_kwargs(model, cache),
                             **{**options, "max_new_tokens": max_new - 1})
        rest = out[:, ids.shape[1] + 1:]
    return torch.cat((ids, ended_rows_padded(torch.cat((first, rest), dim=1), eos, pad)), dim=1), first_at


def refuse_graphs(cache: KVWeaveCache, inputs: dict[str, torch.Tensor], options: dict[str, Any]) -> None:
    """Raise, naming it, for what :func:`generate`'s ``cuda_graphs`` cannot decode: a cache :func:`graph_refusal`
    refuses, sampling or beams (graphs replay greedy steps), padded rows, no ``max_new_tokens``."""
    refusal = graph_refusal(cache)
    if refusal is not None:
        raise CacheStateError(f"CUDA graph decoding: {refusal}")
    unsupported = [name for name, plain in (("do_sample", False), ("num_beams", 1), ("stopping_criteria", None),
                                            ("min_new_tokens", None)) if options.get(name, plain) not in (plain, None)]
    if unsupported:
        raise ValueError(f"CUDA graph decoding is greedy, {', '.join(unsupported)} not taken; leave out cuda_graphs to use them")
    if not isinstance(options.get("max_new_tokens"), int) or options["max_new_tokens"] < 1:
        raise ValueError(f"CUDA graph decoding needs max_new_tokens >= 1, got {options.get('max_new_tokens')!r}")
    mask = inputs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise CacheStateError("CUDA graph decoding: the batch has padding (an attention mask with zeros); feed rows without padding")


def _graph_steps(model: Any, cache: KVWeaveCache, first: torch.Tensor, steps: int, eos: Any, pad: int | None) -> torch.Tensor:
    """The tokens after ``first`` [B, 1] (``model.generate``'s one new token), as ``model.generate`` returns them
    (``eos``: the end-of-sequence id or ids, ``pad`` what follows a row's end)."""
    ends = torch.tensor([] if eos is None else eos, device=first.device).reshape(-1)
    if steps < 1 or bool(torch.isin(first, ends).all()):
        return first[:, :0]
    tokens = graph_decode(model, cache, first[:, -1], steps, eos_token_id=eos)
    return ended_rows_padded(torch.cat((first, tokens), dim=1), eos, pad)[:, 1:]
