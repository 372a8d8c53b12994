"""A repetition forward's attention in two parts merged by their log-sum-exp: the queries over the whole context (no
mask) and over the repetition up to themselves (causal).

KVzip's scoring (:mod:`kvweave.engine.importance`) feeds each chunk of the context again after the whole context, so
each of its ~2K queries attends over ~32K context keys and its own causal prefix. As one call that needs the
lower-right causal mask, which only flash attention 2 takes with grouped heads (4.55 ms a layer and chunk on the H200,
Llama-3-8B's shape at 32K); the context part alone has no mask and runs in cuDNN's attention (3.05 ms with the keys
repeated for the query heads, ``docs/perf/h200-2026-12-03-ttft/run9-gqa.log``), the causal part over the chunk's own
~2K keys is small. Each part returns its rows' log-sum-exp ``lse``; the rows' softmax over both parts is then

    out = out_context * exp(lse_context - lse) + out_own * exp(lse_own - lse),  lse = logaddexp(lse_context, lse_own)

exact up to rounding. :func:`split_attention` runs it where the GPU's kernels are present (bfloat16 or float16, a Hopper
or later GPU, head dims up to 128) and says None otherwise, so the caller keeps its one call; :func:`math_part` is the parts'
plain float32 twin the tests merge on a CPU.
"""

from __future__ import annotations

import torch

#: the largest head dimension the split takes (cuDNN's and flash attention's forward kernels in torch 2.11)
MAX_HEAD_DIM = 128
#: the least CUDA compute capability the split is taken on (Hopper, where it was measured; elsewhere one flash call)
MIN_CAPABILITY = 9


def merge_parts(parts: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype) -> torch.Tensor:
    """The attention over the union of the parts' keys from each part's output [B, H, L, D] and float32 log-sum-exp
    [B, H, L]: their outputs weighted by each part's share of the rows' softmax mass, in ``dtype``."""
    total = parts[0][1]
    for _, lse in parts[1:]:
        total = torch.logaddexp(total, lse)
    out = None
    for part, lse in parts:
        weighted = part.float() * torch.exp(lse - total).unsqueeze(-1)
        out = weighted if out is None else out + weighted
    return out.to(dtype)  # type: ignore[union-attr]


def math_part(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, causal: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One part in float32 by its formula: query [B, Hq, L, D] over key/value [B, H, S, D] (query heads grouped over
    the KV heads; ``causal`` aligned at the last key) -> (output [B, Hq, L, D], log-sum-exp [B, Hq, L])."""
    groups = query.shape[1] // key.shape[1]
    k = key.float().repeat_interleave(groups, 1)
    v = value.float().repeat_interleave(groups, 1)
    logits = query.float() @ k.transpose(-1, -2) * scaling
    if causal:
        rows, cols = logits.shape[-2:]
        hidden = torch.ones(rows, cols, dtype=torch.bool, device=logits.device).triu(cols - rows + 1)
        logits = logits.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(logits, -1)
    return torch.softmax(logits, -1) @ v, lse


def split_ready(query: torch.Tensor) -> bool:
    """Whether :func:`split_attention` runs on ``query``'s device and dtype."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and query.shape[-1] <= MAX_HEAD_DIM
            and torch.cuda.get_device_capability(query.device)[0] >= MIN_CAPABILITY
            and hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and torch.backends.cudnn.is_available())


def split_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor | None:
    """``query`` [B, Hq, F, D] (a repetition's F tokens) over ``key``/``value`` [B, H, C + F, D] (the context's C, then
    the repetition's own, causal) -> [B, Hq, F, D] in the query's dtype; None where :func:`split_ready` says no."""
    if not split_ready(query):
        return None
    fed = query.shape[-2]
    context = key.shape[-2] - fed
    groups = query.shape[1] // key.shape[1]
    k_ctx = key[..., :context, :].repeat_interleave(groups, 1)  # cuDNN's attention reads one KV head a query head
    v_ctx = value[..., :context, :].repeat_interleave(groups, 1)
    out_ctx, lse_ctx = torch.ops.aten._scaled_dot_product_cudnn_attention(
        query, k_ctx, v_ctx, None, True, 0.0, False, False, scale=scaling)[:2]
    own = (key[..., context:, :].contiguous(), value[..., context:, :].contiguous())
    out_own, lse_own = torch.ops.aten._scaled_dot_product_flash_attention(query, *own, 0.0, True, False, scale=scaling)[:2]
    shape = query.shape[:3]
    return merge_parts([(out_ctx, lse_ctx.float().reshape(shape)), (out_own, lse_own.float().reshape(shape))], query.dtype)
