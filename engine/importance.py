"""Context importance by reconstruction, for evictors that choose tokens before any question is known.

KVzip (Kim, Kim, Kwon, Lee, Yun, Song: "KVzip: Query-Agnostic KV Cache Compression with Context
Reconstruction", NeurIPS 2025, arXiv:2505.23416) scores a cached context by asking the model to repeat
it: after the context is prefilled, the model reads "Repeat the previous context exactly." and then the
context again, and each cached key/value pair scores the largest attention probability any query of that
repetition (and any query head of its KV head) gives it. Tokens the model needs to reproduce the context
are the ones a later question can need; those it never looks at can go.

:func:`reconstruction_scores` computes the scores with the model and a plain ``DynamicCache`` (the context
prefilled once, then each chunk of at most ``chunk`` tokens repeated over it; each repetition is written after the
context in room made for it at the prefill and forgotten after its chunk, so chunks never see each other and the
context is never copied). The softmax of a chunk's queries runs over the
first ``sinks`` tokens, the chunk's own context tokens and the repetition itself, as in the paper, so
scores of different chunks compare. Layers whose cache keeps only a sliding window (Gemma 3's local
layers) cannot be scored over the whole context: their scores are ``+inf`` (never evicted by score).

:func:`prefill` is the one entry point the tools use: it scores the tokens when the cache's evictor needs
it (``Evictor.needs_importance``), hands the scores to the cache, then runs the forward that fills it.
The cost is about two extra prefills of the context (KVzip's own figure is 2-3x the prefill); an evictor whose
``surrogate`` is set (the ``kvzip`` evictor's ``scorer = "surrogate"``) gets the scores predicted from one forward
instead (:mod:`kvweave.engine.surrogate`).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvweave.core.errors import CacheStateError
from kvweave.engine.attention import attention_modules, module_queries
from kvweave.engine.copying import copying_layers, layers_at
from kvweave.engine.ingest import ingest as ingest_context
from kvweave.engine.ingest import ingest_refusal
from kvweave.engine.observation import cache_kwargs
from kvweave.engine.split_attention import split_attention
from kvweave.engine.surrogate import surrogate_scores
from kvweave.engine.taps import AttentionHooks, EnergyTap
from kvweave.kernels.scoring import repetition_key_max, repetition_key_max_torch, scoring_kernels_available

#: what the model is asked before the first chunk, and before each later one (then the chunk's last tokens)
REPEAT_PROMPT = "\n\nRepeat the previous context exactly."
REPEAT_CONTINUE = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk quoted after :data:`REPEAT_CONTINUE`
OVERLAP_TOKENS = 8
#: a repetition's attention in two parts on a GPU (:mod:`kvweave.engine.split_attention`); False: one flash call
SPLIT_REPETITION = True
#: the attention implementation the scoring forwards run with (:func:`scoring_attention`)
SCORING_ATTENTION = "kvweave-scoring"


def turn_suffix(tokenizer: Any) -> str:
    """What follows a user turn's text up to where the model's answer starts (the chat template's end of
    turn and generation prompt), or a newline for a tokenizer without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return "\n"
    marker = "\u2063kvweave-marker\u2063"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False, add_generation_prompt=True)
    at = text.rfind(marker)
    if at < 0:
        raise CacheStateError("the tokenizer's chat template changed the user turn's text; cannot build the repeat prompt")
    return text[at + len(marker):]


class _Scorer(AttentionHooks):
    """Forward hooks on the attention modules that turn one repetition forward into scores (``backend``: "triton",
    the kernels of :mod:`kvweave.kernels.scoring`; "torch", their twin)."""

    def __init__(self, model: Any, cache: Any, scores: torch.Tensor, sinks: int, backend: str = "torch") -> None:
        self.cache, self.scores, self.sinks = cache, scores, sinks
        self.modules = attention_modules(model)
        self.start = self.stop = 0
        self.context = scores.shape[-1]
        self.score = repetition_key_max if backend == "triton" else repetition_key_max_torch

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        layer = int(module.layer_idx)
        keys = self.cache.layers[layer].keys
        hidden = args[0] if args else kwargs["hidden_states"]
        fed = hidden.shape[-2]
        if keys is None or keys.shape[-2] != self.context + fed:
            return  # a layer whose cache holds a sliding window only: left at +inf
        queries = module_queries(module, hidden, kwargs["position_embeddings"])
        scaling = float(getattr(module, "scaling", queries.shape[-1] ** -0.5))
        self.scores[layer, :, :, self.start : self.stop] = self.score(
            queries, keys, self.context, self.start, self.stop, min(self.sinks, self.start), scaling)


class _RepetitionLayer(DynamicLayer):
    """A full-attention layer of the scoring cache whose context never moves: the first update (the context pass) writes
    into a buffer with ``room`` spare tokens, and each repetition's keys and values are written after the context in
    place (``rewind`` forgets the previous one) instead of concatenated to a copy of the whole context."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room, self.context = room, None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if self.context is None:  # the context pass: the buffer made, the context written at its start
            batch, heads, tokens, dim = key_states.shape
            self.context = tokens
            self._keys = key_states.new_empty(batch, heads, tokens + self.room, dim)
            self._values = value_states.new_empty(batch, heads, tokens + self.room, value_states.shape[-1])
            self.dtype, self.device, self.is_initialized = key_states.dtype, key_states.device, True
            held = 0
        else:
            held = self.keys.shape[-2]
        end = held + key_states.shape[-2]
        if end > self._keys.shape[-2]:
            raise CacheStateError(f"context scoring: a repetition of {end - self.context} tokens exceeds the {self.room} made room for")
        self._keys[..., held:end, :] = key_states
        self._values[..., held:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    def rewind(self) -> None:
        """Back to the context alone (the next repetition overwrites the last one's room)."""
        self.keys, self.values = self._keys[..., : self.context, :], self._values[..., : self.context, :]


def _scoring_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                       scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """A repetition forward's attention: each query sees the whole context and the repetition up to itself (causal
    aligned at the last key, rows never padded: :func:`score_for` refuses padded ones), so a fused kernel needs no mask
    tensor (the model's mask made sdpa several times slower at 32K). Sliding-window or soft-capped modules, and the
    context's own prefill, take sdpa with the model's mask."""
    from torch.nn.attention.bias import causal_lower_right
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    q_len, k_len = query.shape[-2], key.shape[-2]
    config = getattr(module, "config", None)
    if q_len == k_len or getattr(module, "sliding_window", None) or getattr(config, "attn_logit_softcapping", None):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = split_attention(query, key, value, scale) if SPLIT_REPETITION else None  # cuDNN over the context (engine/split_attention.py)
    if out is not None:
        return out.transpose(1, 2).contiguous(), None
    # the query heads of a KV head read its keys as they are (flash attention takes grouped heads with a lower-right
    # mask: 4.55 ms against 8.62 ms with the keys repeated, a 2,070-token repetition over 32K on the H200)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=causal_lower_right(q_len, k_len), scale=scaling,
                                                           enable_gqa=query.shape[1] != key.shape[1])
    return out.transpose(1, 2).contiguous(), None


@contextlib.contextmanager
def scoring_attention(model: Any) -> Iterator[None]:
    """The model attends with :func:`_scoring_attention` for the duration (its previous attention restored after)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(SCORING_ATTENTION, _scoring_attention)
    AttentionMaskInterface.register(SCORING_ATTENTION, sdpa_mask)
    previous = model.config._attn_implementation
    model.set_attn_implementation(SCORING_ATTENTION)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def reconstruction_scores(
    model: Any, tokenizer: Any, input_ids: torch.Tensor, *, chunk: int = 2048, sinks: int = 4, progress: bool = False,
    backend: str = "auto", keep: list | None = None, energy: Any = None, logits: list | None = None,
) -> torch.Tensor:
    """KVzip's importance of every cached token of ``input_ids`` [B, T] (no padding): float32
    [L, B, H, T] on the model's device, the largest attention probability a repetition query gives it
    (``+inf`` for layers that keep a sliding window only). See the module's docstring. ``backend``: how each chunk's
    probabilities are reduced ("triton": :func:`kvweave.kernels.scoring.repetition_key_max`, never in memory; "torch":
    its twin, formed whole; "auto": Triton on a GPU where it is installed). ``keep``: a list that receives each layer's
    (keys, values) of the context pass (:func:`kvweave.engine.ingest.ingest` stores them without a second forward);
    ``energy``: a :class:`~kvweave.engine.energy.QueryEnergy` that records the context pass's queries, as a cache's
    own forward over the context would have; ``logits``: a list that receives the context pass's logits of the last
    token [B, V]."""
    from transformers import DynamicCache

    if input_ids.dim() != 2 or input_ids.shape[-1] < 1:
        raise CacheStateError(f"context scoring takes input_ids [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
    if chunk < 1:
        raise CacheStateError(f"context scoring chunk must be >= 1 token, got {chunk}")
    if tokenizer is None:
        raise CacheStateError("context scoring builds the repeat prompt with the tokenizer: pass tokenizer= to build_cache")
    if backend not in ("auto", "torch", "triton"):
        raise CacheStateError(f"context scoring backend must be 'auto', 'torch' or 'triton', got {backend!r}")
    if backend == "auto":
        backend = "triton" if model.device.type == "cuda" and scoring_kernels_available() else "torch"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    layers = int(config.num_hidden_layers)
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    batch, total = input_ids.shape
    device = model.device
    ids = input_ids.to(device)
    encode = lambda text: tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"].to(device)  # noqa: E731
    suffix = encode(turn_suffix(tokenizer))
    scores = torch.full((layers, batch, heads, total), float("inf"), dtype=torch.float32, device=device)
    starts = list(range(0, total, chunk))
    feeds = []
    for start in starts:
        if start == 0:
            ask = encode(REPEAT_PROMPT).expand(batch, -1)
        else:  # each row quotes the end of its own previous chunk
            ask = torch.cat((encode(REPEAT_CONTINUE).expand(batch, -1), ids[:, max(0, start - OVERLAP_TOKENS) : start]), dim=-1)
        feeds.append(torch.cat((ask, suffix.expand(batch, -1), ids[:, start : min(total, start + chunk)]), dim=-1))
    cache = DynamicCache(config=model.config)
    room = max(fed.shape[-1] for fed in feeds)
    cache.layers = [_RepetitionLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(starts), desc=f"scoring {total:,} tokens", unit="chunk", dynamic_ncols=True)
    with torch.inference_mode(), scoring_attention(model):
        with EnergyTap(model, energy, heads):
            out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
        if logits is not None:
            logits.append(out.logits[:, -1])
        saved = [copy.copy(layer) for layer in cache.layers]
        if keep is not None:
            keep.extend((layer.keys, layer.values) for layer in saved)
        scorer = _Scorer(model, cache, scores, sinks, backend)
        with scorer:
            for start, fed in zip(starts, feeds):
                stop = min(total, start + chunk)
                for layer in saved:
                    if isinstance(layer, _RepetitionLayer):
                        layer.rewind()
                cache.layers = [layer if isinstance(layer, _RepetitionLayer) else copy.copy(layer) for layer in saved]
                scorer.start, scorer.stop = start, stop
                model(input_ids=fed, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
                if bar is not None:
                    bar.update(1)
    if bar is not None:
        bar.close()
    if sinks:
        scores[..., :sinks] = float("inf")
    return scores


def needs_importance(cache_or_pipeline: Any) -> bool:
    """Whether the evictor of a cache (or of a resolved pipeline) chooses tokens by context importance (then
    feed it with :func:`prefill`)."""
    pipeline = getattr(cache_or_pipeline, "pipeline", cache_or_pipeline)
    if "evictor" not in getattr(pipeline, "slots", ()):  # a DynamicCache, or a pipeline without the slot
        return False
    evictor = pipeline.component("evictor")
    return bool(evictor.evicts and getattr(evictor, "needs_importance", False))


def score_for(model: Any, cache: Any, input_ids: torch.Tensor, progress: bool = False,
              attention_mask: torch.Tensor | None = None, ingest: bool = False) -> int:
    """Score ``input_ids`` [B, T] for ``cache`` when its evictor needs it and the cache is still empty. ``ingest``: where
    the cache can take them (:func:`kvweave.engine.ingest.ingest_refusal`), the first T - 1 tokens are scored and
    stored from the scoring's own context pass, so the caller's forward (``model.generate``, which feeds the tokens a
    cache does not hold yet) runs over the last token only. Returns the tokens of ``input_ids`` now in the cache."""
    return _score(model, cache, input_ids, progress, attention_mask, ingest, whole=False)[0]


def score_whole(model: Any, cache: Any, input_ids: torch.Tensor, progress: bool = False,
                attention_mask: torch.Tensor | None = None) -> torch.Tensor | None:
    """Score ``input_ids`` [B, T] for ``cache`` and store every one of its tokens from the scoring's own context pass,
    where the evictor needs scores, the cache is empty and can take them: then the logits of the prompt's last token
    [B, V] from that pass (the next token's, computed as a full cache computes them: the prompt attends to itself
    exactly), so no forward of the prompt follows. None where it stored nothing (the caller then feeds the prompt)."""
    stored, logits = _score(model, cache, input_ids, progress, attention_mask, True, whole=True)
    return logits if stored == input_ids.shape[-1] else None


def _score(model: Any, cache: Any, input_ids: torch.Tensor, progress: bool, attention_mask: torch.Tensor | None,
           ingest: bool, whole: bool) -> tuple[int, torch.Tensor | None]:
    """:func:`score_for` (``whole`` False: the last token left to the caller's forward) and :func:`score_whole`: the
    tokens stored, and the scoring pass's last logits where ``whole`` stored them all."""
    if not needs_importance(cache) or cache.get_seq_length() != 0:
        return 0, None
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise CacheStateError(
            f"pipeline '{cache.pipeline.name}': its evictor scores whole rows of context; this batch is padded "
            "(feed its rows one at a time)")
    evictor = cache.pipeline.component("evictor")
    tokenizer = getattr(cache, "tokenizer", None)
    surrogate = getattr(evictor, "surrogate", None)
    ingesting = ingest and input_ids.shape[-1] >= 2 and ingest_refusal(cache, whole_windows=surrogate is not None) is None
    scored = input_ids[:, :-1] if ingesting and not whole else input_ids
    kept: list | None = [] if ingesting else None
    energy = cache.engine.energy if ingesting else None
    logits: list | None = [] if ingesting and whole else None
    if surrogate is not None:  # one forward: its attention inputs mapped to predicted scores
        scores = surrogate_scores(model, scored, surrogate, sinks=getattr(evictor, "sinks", 4), keep=kept, energy=energy,
                                  logits=logits)
    else:
        scores = reconstruction_scores(model, tokenizer, scored, chunk=getattr(evictor, "chunk", 2048),
                                       sinks=getattr(evictor, "sinks", 4), progress=progress,  # an evictor's own, else KVzip's
                                       keep=kept, energy=energy, logits=logits)
    threshold = float(getattr(evictor, "copying", 0.0) or 0.0)
    if threshold:  # the copying layers keep every token: +inf is kept whatever the cut and not counted
        induction = surrogate.get("induction") if surrogate is not None else None  # measured when the map was fitted
        layers = copying_layers(model, tokenizer, threshold) if induction is None else layers_at(induction, threshold)
        for layer in layers:
            scores[layer] = float("inf")
        if progress:
            print(f"kvweave: copying layers (induction score >= {threshold:g}) keep every token: "
                  f"{', '.join(map(str, layers)) or 'none'}", file=sys.stderr, flush=True)
    cache.set_importance(scores)
    if kept is None:
        return 0, None
    ingest_context(cache, kept)
    return int(scored.shape[-1]), logits[0] if logits else None


def prefill(model: Any, cache: Any, input_ids: torch.Tensor, progress: bool = False, ingest: bool = False) -> None:
    """``input_ids`` [B, T] into ``cache`` by one forward, scored first when its evictor needs importance (``ingest``:
    see :func:`score_for`; the forward then feeds the last token only)."""
    done = score_for(model, cache, input_ids, progress, ingest=ingest)
    with torch.inference_mode():
        model(input_ids=input_ids[:, done:], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
