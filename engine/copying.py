"""The layers of a model that copy from their context, found without any question: induction scores.

An induction head (Olsson et al., "In-context Learning and Induction Heads", 2022) completes ``A B ... A`` with
``B``: at the second ``A`` it attends to the token after the first one. That is how a model answers a question
from its context, and the heads that do it are few and fixed per model (Wu et al., "Retrieval Head Mechanistically
Explains Long-Context Factuality", arXiv:2404.15574; RazorAttention, arXiv:2407.15891, scores them this way).

:func:`induction_scores` feeds ``rows`` sequences of ``length`` random token ids, each repeated twice after the BOS
token, into a plain ``DynamicCache`` and, for every query of the second copy (but its last), takes the attention
probability it gives to the position after its earlier occurrence; the mean over queries and rows, and the largest
over the query heads of each KV head, is the KV head's score [L, H]. A layer whose cache keeps a sliding window
shorter than the sequence scores 0 (it cannot copy from far back anyway). The ``kvzip`` evictor's ``copying``
threshold keeps every token of the layers with a KV head at or above it (:func:`copying_layers`);
``benchmarks/induction_heads.py`` prints the table.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from kvweave.core.errors import CacheStateError
from kvweave.engine.attention import attention_modules, module_queries
from kvweave.engine.observation import cache_kwargs, plain_attention

#: random tokens per copy and sequences averaged (two copies and BOS fit Gemma-3's 512-token windows)
LENGTH, ROWS = 200, 3
_SCORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def random_ids(vocab: int, bos: int | None, length: int = LENGTH, rows: int = ROWS, seed: int = 0) -> torch.Tensor:
    """[rows, 1 + 2 length] (without BOS: 2 length): BOS, then ``length`` random ids past the special and byte
    tokens of common vocabularies, then the same ids again."""
    low = min(1000, vocab // 4)
    body = torch.randint(low, vocab, (rows, length), generator=torch.Generator().manual_seed(seed))
    head = [] if bos is None else [torch.full((rows, 1), bos)]
    return torch.cat([*head, body, body], dim=-1)


def induction_scores(model: Any, ids: torch.Tensor, length: int) -> torch.Tensor:
    """float32 [L, H] induction score of each KV head over ``ids`` [rows, T] whose last ``2 length`` tokens are a
    sequence repeated twice (see the module's docstring)."""
    from transformers import DynamicCache

    rows, total = ids.shape
    if length < 2 or total < 2 * length:
        raise CacheStateError(f"induction scores need two copies of at least 2 tokens, got {total} tokens for copies of {length}")
    modules = attention_modules(model)
    first = total - length  # the second copy's first position
    queries = torch.arange(first, total - 1)
    targets = queries - length + 1  # the position after each token's earlier occurrence
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    scores = torch.zeros(len(modules), heads)
    cache = DynamicCache(config=model.config)

    def hook(module: Any, args: tuple, kwargs: dict, _output: Any) -> None:
        layer = int(module.layer_idx)
        keys = cache.layers[layer].keys
        if keys is None or keys.shape[-2] != total:
            return  # a sliding window shorter than the sequence: scores 0
        hidden = args[0] if args else kwargs["hidden_states"]
        cos, sin = kwargs["position_embeddings"]
        q = module_queries(module, hidden[:, first : total - 1], (cos[:, first : total - 1], sin[:, first : total - 1])).float()
        grouped = q.reshape(rows, heads, q.shape[1] // heads, len(queries), q.shape[-1])
        logits = grouped @ keys.float().transpose(-1, -2).unsqueeze(2) * float(getattr(module, "scaling", q.shape[-1] ** -0.5))
        future = torch.arange(total, device=logits.device)[None, :] > queries.to(logits.device)[:, None]  # [Q, T]
        probs = logits.masked_fill(future, float("-inf")).softmax(dim=-1)  # [B, H, G, Q, T]
        at = probs.gather(-1, targets.to(probs.device).view(1, 1, 1, -1, 1).expand(*probs.shape[:-1], 1))[..., 0]
        scores[layer] = at.mean(dim=(0, 3)).amax(dim=-1).cpu()  # mean over rows and queries, largest query head

    handles = [m.register_forward_hook(hook, with_kwargs=True) for m in modules]
    try:
        with torch.inference_mode(), plain_attention(model):
            model(input_ids=ids.to(model.device), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    finally:
        for handle in handles:
            handle.remove()
    return scores


def model_induction_scores(model: Any, bos: int | None) -> torch.Tensor:
    """:func:`induction_scores` of ``model`` on :func:`random_ids` from its input vocabulary (after ``bos`` where
    given), computed once per model."""
    if model not in _SCORES:
        vocab = int(model.get_input_embeddings().num_embeddings)
        _SCORES[model] = induction_scores(model, random_ids(vocab, bos), LENGTH)
    return _SCORES[model]


def layers_at(scores: torch.Tensor, threshold: float) -> list[int]:
    """The layers of induction ``scores`` [L, H] with a KV head scoring at least ``threshold``."""
    return [layer for layer in range(scores.shape[0]) if float(scores[layer].max()) >= threshold]


def copying_layers(model: Any, tokenizer: Any, threshold: float) -> list[int]:
    """The layers with a KV head whose induction score is at least ``threshold`` (the tokenizer's BOS, if it has
    one, starts the sequences)."""
    return layers_at(model_induction_scores(model, getattr(tokenizer, "bos_token_id", None)), threshold)
