"""Quality metrics of a compressed cache: attention-output error (the paper's Eq. 3), perplexity while the
cache fills, and needle-in-a-haystack prompts and scoring.

Every function takes the model and tensors it works on and keeps no state, so an evaluation command can
reuse them. Shapes: ``input_ids`` is ``[1, T]`` (one sequence); queries are ``[B, Hq, P, D]`` and keys and
values ``[B, H, T, D]`` (``Hq`` query heads, ``H`` KV heads, ``P`` probe positions, ``D`` head dim).

Feeding (:func:`feed`): a prompt enters the cache as generation would see it: an optional prefill forward,
then chunks of ``chunk`` tokens, so a compressing cache packs blocks as it fills and every later chunk
attends over the reconstruction of what was packed.
"""

from __future__ import annotations

import contextlib
import math
import re
import unicodedata
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from transformers import DynamicCache

from kvweave.core.interfaces import KINDS
from kvweave.core.registry import Registry, ResolvedPipeline
from kvweave.core.view import LayerView
from kvweave.engine.generation import cache_kwargs
from kvweave.engine.attention import module_queries
from kvweave.engine.importance import score_for
from kvweave.engine.observation import plain_attention  # noqa: F401 (tools import it from here)
from kvweave.engine.pipeline import build_cache
from kvweave.engine.taps import AttentionHooks


# ------------------------------------------------------------------------------------------- feeding
def segments(total: int, chunk: int, prefill: int = 0) -> list[tuple[int, int]]:
    """``(start, end)`` of each forward: ``0..prefill`` (when ``prefill > 0``), then ``chunk``-token pieces."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    prefill = max(0, min(prefill, total))
    bounds = [(0, prefill)] if prefill else []
    bounds += [(start, min(start + chunk, total)) for start in range(prefill, total, chunk)]
    return bounds


def feed(
    model: Any, cache: Any, input_ids: torch.Tensor, chunk: int, prefill: int = 0,
    on_logits: Callable[[int, torch.Tensor], None] | None = None,
) -> None:
    """Run ``input_ids`` [1, T] through ``model`` into ``cache`` piece by piece (see :func:`segments`).

    ``on_logits(start, logits)`` gets each forward's logits [1, n, V] (float32); without it only the last
    position's logits are computed (the LM head over every position is the costliest part on CPU)."""
    with torch.inference_mode():
        for start, end in segments(input_ids.shape[-1], chunk, prefill):
            piece = input_ids[:, start:end]
            keep = 0 if on_logits is not None else 1
            out = model(input_ids=piece, use_cache=True, logits_to_keep=keep, **cache_kwargs(model, cache))
            if on_logits is not None:
                on_logits(start, out.logits.float())


class QueryTap(AttentionHooks):
    """Records the post-RoPE queries [1, Hq, P, D] of the last ``positions`` tokens of every attention layer.

    A forward pre-hook on each attention module (one with ``q_proj`` and ``layer_idx``) recomputes the
    queries of the last positions from the module's input and its ``position_embeddings`` (cos, sin),
    exactly as the module does (``q_norm`` too, where the model has one)."""

    pre = True

    def __init__(self, model: Any, positions: int) -> None:
        self.positions = positions
        self.queries: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        self.modules = [m for m in model.modules() if hasattr(m, "q_proj") and hasattr(m, "layer_idx")]
        if not self.modules:
            raise ValueError(f"{type(model).__name__} has no attention modules with q_proj and layer_idx")
        self.handles: list[Any] = []

    def _hook(self, module: Any, args: tuple, kwargs: dict, *output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        keep = self.positions
        query = module_queries(module, hidden[:, -keep:], (cos[:, -keep:], sin[:, -keep:]))
        old = self.queries.get(module.layer_idx)
        joined = query if old is None else torch.cat((old, query), dim=-2)
        self.queries[module.layer_idx] = joined[..., -keep:, :].float().clone()
        self.scaling[module.layer_idx] = float(getattr(module, "scaling", module.head_dim**-0.5))


def attention_outputs(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float,
    key_positions: torch.Tensor | None = None, total: int | None = None,
) -> torch.Tensor:
    """Causal attention of the last ``P`` positions: queries [B, Hq, P, D] over keys/values [B, H, T, D]
    (query head ``h`` reads KV head ``h // (Hq / H)``, as transformers' ``repeat_kv``). Returns
    [B, H, Hq/H, P, D] in float32; query ``i`` sits at position ``total - P + i`` and sees keys at positions
    ``<=`` it. Key ``j`` sits at position ``j`` (``total = T``), or at ``key_positions`` [B, H, T] (-1: a slot
    no query sees) for a cache that dropped tokens, whose ``total`` is the logical token count."""
    batch, q_heads, probes, dim = queries.shape
    heads, count = keys.shape[1], keys.shape[-2]
    total = count if total is None else total
    grouped = queries.float().reshape(batch, heads, q_heads // heads, probes, dim)
    logits = grouped @ keys.float().transpose(-1, -2).unsqueeze(2) * scaling  # [B, H, G, P, T]
    query_pos = total - probes + torch.arange(probes, device=keys.device)
    if key_positions is None:
        key_positions = torch.arange(count, device=keys.device).expand(batch, heads, count)
    key_positions = key_positions.to(keys.device).long()
    hidden = (key_positions[:, :, None, :] > query_pos[None, None, :, None]) | (key_positions[:, :, None, :] < 0)  # [B, H, P, T]
    probs = logits.masked_fill(hidden.unsqueeze(2), float("-inf")).softmax(dim=-1)
    return probs @ values.float().unsqueeze(2)


def stored_positions(view: LayerView) -> torch.Tensor | None:
    """The logical position of every key a layer's cache returns (its packed slots, then its exact window),
    [B, H, T] (-1 for a filler slot), from the layer's read-only storage ``view`` (``engine.view(layer)``);
    None when the cache drops nothing (key ``j`` is then token ``j``)."""
    if view.positions is None:
        return None
    exact = view.keys.exact
    recent = torch.arange(view.passed_tokens, view.passed_tokens + exact.shape[-2], device=exact.device)
    return torch.cat((view.positions.to(exact.device).long(), recent.expand(*exact.shape[:2], -1)), dim=-1)


def relative_output_error(reference: torch.Tensor, approx: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Eq. (3) per KV head: ``||O - O_hat|| / (||O|| + eps)``, Frobenius norm over a head's query heads,
    probe positions and channels. ``reference``/``approx`` [B, H, G, P, D] -> [H] (averaged over batch)."""
    diff = (reference - approx).flatten(2).norm(dim=-1)
    return (diff / (reference.flatten(2).norm(dim=-1) + eps)).mean(dim=0)


def reference_pass(model: Any, input_ids: torch.Tensor, chunk: int = 64, prefill: int | None = None, probe: int = 32) -> dict[str, Any]:
    """Feed ``input_ids`` [1, T] into a DynamicCache (prefill ``T // 2`` by default, then chunks) and keep
    what :func:`attention_output_error` compares against: per layer the keys and values [1, H, T, D], the
    probe queries [1, Hq, probe, D] of the last ``probe`` positions and the attention scaling."""
    prefill = input_ids.shape[-1] // 2 if prefill is None else prefill
    if not 0 < probe <= input_ids.shape[-1]:
        raise ValueError(f"probe must be in 1..{input_ids.shape[-1]} (the tokens given), got {probe}")
    cache = DynamicCache(config=model.config)
    with plain_attention(model), QueryTap(model, probe) as tap:
        feed(model, cache, input_ids, chunk, prefill)
    layers = range(len(cache.layers))
    return {
        "keys": [cache.layers[i].keys for i in layers],
        "values": [cache.layers[i].values for i in layers],
        "queries": [tap.queries[i] for i in layers],
        "scaling": [tap.scaling[i] for i in layers],
        "chunk": chunk, "prefill": prefill, "probe": probe, "tokens": int(input_ids.shape[-1]),
    }


def attention_output_error(
    model: Any, tokenizer: Any, pipeline: str | ResolvedPipeline, input_ids: torch.Tensor, device: str | torch.device,
    *, chunk: int = 64, prefill: int | None = None, probe: int = 32, registry: Registry | str | None = None,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Eq. (3) of the paper for ``pipeline`` after feeding ``input_ids`` [1, T] (prefill ``T // 2``, then
    chunks of ``chunk`` tokens), against a DynamicCache fed identically.

    Per layer and KV head: ``||Attn(Q, K, V) - Attn(Q, K_hat, V_hat)|| / ||Attn(Q, K, V)||`` where ``Q`` are
    the reference run's post-RoPE queries of the last ``probe`` positions (causal), ``K, V`` the reference
    cache's and ``K_hat, V_hat`` the compressed cache's reconstruction of all its tokens (packed blocks
    decoded, then the exact window). So the error includes what compression of earlier chunks changed in
    later chunks' keys and values. A cache that dropped tokens (eviction routers) is attended over what it
    kept, each key at its logical position. A sliding-window layer is compared over the tokens the reference's
    own cache keeps of it (its last window), whatever the compressed cache holds beyond them. ``reference`` (from :func:`reference_pass` with the same
    arguments) skips the reference run.

    Returns ``per_layer`` (L floats, mean over KV heads), ``per_head`` ([L][H]), ``mean`` (over layers),
    and the compressed cache's ``memory_bytes``, ``full_16bit_bytes`` and ``breakdown`` after the feed.
    """
    input_ids = input_ids.to(device)
    prefill = input_ids.shape[-1] // 2 if prefill is None else prefill
    if reference is None:
        reference = reference_pass(model, input_ids, chunk, prefill, probe)
    elif (reference["chunk"], reference["prefill"], reference["probe"], reference["tokens"]) != (chunk, prefill, probe, input_ids.shape[-1]):
        raise ValueError("reference was computed with another chunk, prefill, probe or token count")
    cache = build_cache(pipeline, model, registry=registry, tokenizer=tokenizer)
    feed(model, cache, input_ids, chunk, prefill)
    per_head = []
    with torch.inference_mode():
        for layer, (queries, keys, values, scaling) in enumerate(
            zip(reference["queries"], reference["keys"], reference["values"], reference["scaling"])
        ):
            approx_keys, approx_values = (cache.engine.materialize(layer, kind) for kind in KINDS)
            view = cache.engine.view(layer)
            positions = stored_positions(view)
            total, count = reference["tokens"], keys.shape[-2]
            ref_positions = None
            if count < total:  # a sliding-window layer: the reference keeps its last `count` tokens
                ref_positions = torch.arange(total - count, total, device=keys.device).expand(*keys.shape[:2], count)
                if positions is None:  # the compressed layer's packed tokens (its older blocks dropped), then its window
                    held = approx_keys.shape[-2]
                    first = view.passed_tokens - view.packed_tokens
                    positions = torch.arange(first, first + held, device=keys.device).expand(*approx_keys.shape[:2], held)
                positions = positions.to(keys.device).masked_fill(positions.to(keys.device) < total - count, -1)  # the reference's tokens only
            if positions is None and approx_keys.shape != keys.shape:
                raise RuntimeError(f"layer {layer}: compressed cache holds {tuple(approx_keys.shape)}, reference {tuple(keys.shape)}")
            exact = attention_outputs(queries, keys, values, scaling, ref_positions, total)
            approx = attention_outputs(queries, approx_keys, approx_values, scaling, positions, total)
            per_head.append(relative_output_error(exact, approx).tolist())
    per_layer = [sum(h) / len(h) for h in per_head]
    return {
        "per_layer": per_layer,
        "per_head": per_head,
        "mean": sum(per_layer) / len(per_layer),
        "memory_bytes": cache.memory_bytes(),
        "full_16bit_bytes": cache.full_cache_bytes_16bit(),
        "breakdown": cache.memory_breakdown(),
    }


# ------------------------------------------------------------------------------------------ perplexity
def perplexity(model: Any, cache_or_none: Any, input_ids: torch.Tensor, chunk: int, prefill: int = 0) -> float:
    """Perplexity of ``input_ids`` [1, T] fed in ``chunk``-token pieces into ``cache_or_none`` (``None``: a
    fresh DynamicCache). Each forward's logits score the next tokens; the last logit of a piece scores the
    first token of the next, so all ``T - 1`` are scored. With ``prefill = P > 0`` the first ``P`` tokens
    are one forward (scored first when the cache's evictor chooses by context importance) and only the
    ``T - P`` tokens after it are scored: the continuation read over what the cache kept of the prefill."""
    input_ids = input_ids.to(model.device)
    cache = DynamicCache(config=model.config) if cache_or_none is None else cache_or_none
    total = {"nll": 0.0, "count": 0}
    if not 0 <= prefill < input_ids.shape[-1]:
        raise ValueError(f"prefill must be in 0..{input_ids.shape[-1] - 1} for {input_ids.shape[-1]} tokens, got {prefill}")

    def score(start: int, logits: torch.Tensor) -> None:
        targets = input_ids[0, start + 1 : start + 1 + logits.shape[1]]
        logprobs = logits[0, : targets.shape[0]].log_softmax(dim=-1)
        total["nll"] -= logprobs.gather(-1, targets[:, None]).sum().item()
        total["count"] += targets.shape[0]

    context = plain_attention(model) if cache_or_none is None else contextlib.nullcontext()
    with context, torch.inference_mode():
        if prefill:
            score_for(model, cache, input_ids[:, :prefill])
            out = model(input_ids=input_ids[:, :prefill], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            score(prefill - 1, out.logits.float())
            for start in range(prefill, input_ids.shape[-1], chunk):
                piece = input_ids[:, start : start + chunk]
                score(start, model(input_ids=piece, use_cache=True, logits_to_keep=0, **cache_kwargs(model, cache)).logits.float())
        else:
            feed(model, cache, input_ids, chunk, 0, on_logits=score)
    if total["count"] == 0:
        raise ValueError("perplexity needs at least 2 tokens")
    return math.exp(total["nll"] / total["count"])


# ------------------------------------------------------------------------------------------- needles
PROMPT_INTRO = "Read the following text carefully; you will be asked about one fact stated in it.\n\n"
PROMPT_QUESTION = "\n\nQuestion: {question} Answer with the exact value from the text."  # the question part
_SENTENCE_END = re.compile(r"[.!?][\"')\]]*(?=\s|[A-Z\"']|$)")


def sentence_boundaries(text: str) -> list[int]:
    """Character offsets where a sentence may start: 0, after each ``.``/``!``/``?`` (and closing quotes)
    followed by whitespace, a capital letter or the end, and ``len(text)``."""
    return sorted({0, len(text), *(match.end() for match in _SENTENCE_END.finditer(text))})


def needle_prompt(tokenizer: Any, haystack_text: str, needle: str, question: str, context_tokens: int, depth: float) -> str:
    """A prompt of about ``context_tokens`` tokens: an instruction, the start of ``haystack_text`` with
    ``needle`` inserted at the sentence boundary nearest to relative depth ``depth`` (0 = start, 1 = end,
    measured in tokens of the haystack), then ``question``. Returns plain text (apply a chat template on top)."""
    return "".join(needle_prompt_parts(tokenizer, haystack_text, [needle], [depth], question, context_tokens))


def needle_prompt_parts(
    tokenizer: Any, haystack_text: str, needles: Sequence[str], depths: Sequence[float], question: str, context_tokens: int,
) -> tuple[str, str]:
    """The needle prompt of about ``context_tokens`` tokens as ``(context, question part)``, plain text whose
    concatenation is the whole prompt: the context is the instruction and the start of ``haystack_text``
    with each of ``needles`` inserted at the sentence boundary nearest to its relative depth in ``depths``
    (0 = start, 1 = end, measured in tokens of the haystack; needles at the same boundary follow each
    other in the given order); the question part is a blank line, ``question`` and the request for the
    exact value (:data:`PROMPT_QUESTION`: it starts with the line breaks, which byte-level BPE tokenizers
    cut from the letters after them, so the two parts usually tokenize apart into the prompt's ids).
    Query-agnostic evaluation prefills the context before the question is read."""
    if len(needles) != len(depths) or not needles:
        raise ValueError(f"one depth per needle: {len(needles)} needles, {len(depths)} depths")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"depth must be in [0, 1], got {depth}")
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    tail = PROMPT_QUESTION.format(question=question)
    budget = context_tokens - count(PROMPT_INTRO) - count(tail) - sum(count(" " + needle) for needle in needles)
    if budget < 1:
        raise ValueError(f"context_tokens {context_tokens} leaves no room for a haystack")
    chars = budget * 8  # tokenize only a slice: a few characters per token in English prose
    ids = tokenizer(haystack_text[:chars], add_special_tokens=False)["input_ids"]
    while len(ids) < budget and chars < len(haystack_text):
        chars *= 2
        ids = tokenizer(haystack_text[:chars], add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(ids[:budget])
    bounds = sentence_boundaries(text)
    last = max((b for b in bounds if b < len(text)), default=0)
    if last >= 0.9 * len(text):  # end on a whole sentence when that costs little
        text = text[:last]
        bounds = [b for b in bounds if b <= last]
    kept = tokenizer(text, add_special_tokens=False)["input_ids"]
    places = []
    for depth in depths:
        target = len(tokenizer.decode(kept[: round(depth * budget)]))
        places.append(min(bounds, key=lambda b: abs(b - target)))
    parts, start = [], 0
    for number, order in enumerate(sorted(range(len(needles)), key=lambda i: (places[i], i))):
        piece = text[start : places[order]].rstrip()  # whitespace around a needle becomes one space
        parts += [piece.lstrip() if number else piece, needles[order]]
        start = places[order]
    parts.append(text[start:].lstrip())
    return PROMPT_INTRO + " ".join(part for part in parts if part), tail


def _normalize(text: str, squash: bool) -> str:
    text = unicodedata.normalize("NFKC", text).lower()
    text = "".join(" " if unicodedata.category(c)[0] in "PS" else c for c in text)
    return re.sub(r"\s+", "" if squash else " ", text).strip()


def needle_hit(answer: str, expected: str) -> bool:
    """Whether ``expected`` occurs in ``answer``, ignoring case, punctuation and whitespace: compared word
    by word (punctuation as spaces), or with all punctuation and spaces removed ("7,341" matches "7341")."""
    if not _normalize(expected, squash=True):
        return False
    return _normalize(expected, False) in _normalize(answer, False) or _normalize(expected, True) in _normalize(answer, True)
