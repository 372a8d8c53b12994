"""KVzip's score of one repetition chunk (:mod:`kvweave.engine.importance`): for each key of the chunk's own context,
the largest attention probability any query of the repetition (and any query head of its KV head) gives it, the
softmax of each query running over the first ``sinks`` keys, the chunk's context and the repetition up to itself.

:func:`repetition_key_max_torch` forms the probabilities [B, H, G, F, S] (float32: ~1 GB a layer for a 2,048-token
chunk of Llama-3-8B's shape, read and written several times); :func:`repetition_key_max` gives the same scores from two
Triton kernels (:mod:`kvweave.kernels.scoring_triton`) that keep them in registers: one finds each query row's
log-sum-exp over its keys, the other each context key's largest ``exp(logit - lse)``. The torch function is the
kernels' twin in the tests and the path without Triton or a GPU.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from kvweave.core.lazy import lazy_module, torch

if TYPE_CHECKING:
    from kvweave.kernels import scoring_triton as jit
else:
    jit: Any = lazy_module("kvweave.kernels.scoring_triton")

#: query rows and keys a program takes at a time (tensor-core tiles), and at head dims above 128 (a [64, 256] tile of
#: each operand would not leave the registers for the logits)
ROW_TILE, KEY_TILE, WIDE_TILE = 64, 64, 32
LOG2E = 1.4426950408889634


def _check(queries: torch.Tensor, keys: torch.Tensor, context: int, start: int, stop: int, sinks: int) -> None:
    if queries.dim() != 4 or keys.dim() != 4 or queries.shape[0] != keys.shape[0] or queries.shape[-1] != keys.shape[-1]:
        raise ValueError(f"repetition scores take queries [B, Hq, F, D] and keys [B, H, L, D] of one B and D; got "
                         f"{tuple(queries.shape)} and {tuple(keys.shape)}")
    batch, q_heads, fed, dim = queries.shape
    heads, length = keys.shape[1], keys.shape[2]
    if q_heads % heads:
        raise ValueError(f"repetition scores: {q_heads} query heads do not group over {heads} KV heads")
    if length != context + fed:
        raise ValueError(f"repetition scores: keys hold {length} tokens; expected the context's {context} and the {fed} fed")
    if not (0 <= start < stop <= context) or not 0 <= sinks <= start:
        raise ValueError(f"repetition scores: chunk {start}..{stop} and {sinks} sinks do not fit a {context}-token context "
                         "(0 <= sinks <= start < stop <= context)")


def repetition_key_max_torch(queries: torch.Tensor, keys: torch.Tensor, context: int, start: int, stop: int, sinks: int,
                             scaling: float) -> torch.Tensor:
    """float32 [B, H, stop - start]: the scores of context keys ``start .. stop`` for ``queries`` [B, Hq, F, D] (the
    fed repetition's, after RoPE) over ``keys`` [B, H, context + F, D] (the cache after the repetition's forward)."""
    _check(queries, keys, context, start, stop, sinks)
    batch, q_heads, fed, dim = queries.shape
    heads = keys.shape[1]
    chosen = torch.cat((keys[..., :sinks, :], keys[..., start:stop, :], keys[..., context:, :]), dim=-2).float()
    grouped = queries.float().reshape(batch * heads, q_heads // heads * fed, dim)
    with exact_half_products(keys):  # the scale applied by the product itself: no pass over the logits for it
        logits = torch.baddbmm(grouped.new_zeros(1, 1, 1), grouped, chosen.reshape(batch * heads, -1, dim).transpose(-1, -2),
                               beta=0.0, alpha=scaling).view(batch, heads, q_heads // heads, fed, -1)  # [B, H, G, F, S]
    own = torch.ones(fed, fed, dtype=torch.bool, device=logits.device).triu(1)  # the repetition is causal
    logits[..., -fed:].masked_fill_(own, float("-inf"))
    probs = logits.softmax(dim=-1)[..., sinks : sinks + stop - start]
    return probs.amax(dim=(2, 3))


class exact_half_products:
    """float32 products on a GPU's TF32 units where the operands were bfloat16 or float16 values (the cache's keys and
    the model's queries): TF32 keeps their every bit, so the logits are the float32 ones, several times faster."""

    def __init__(self, keys: torch.Tensor) -> None:
        self.on = keys.device.type == "cuda" and keys.dtype in (torch.bfloat16, torch.float16)

    def __enter__(self) -> None:
        if self.on:
            self.previous = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision("high")

    def __exit__(self, *exc: Any) -> None:
        if self.on:
            torch.set_float32_matmul_precision(self.previous)


def scoring_kernels_available() -> bool:
    """Whether Triton is installed (the kernels' module defines them)."""
    return jit.triton is not None


def repetition_key_max(queries: torch.Tensor, keys: torch.Tensor, context: int, start: int, stop: int, sinks: int,
                       scaling: float) -> torch.Tensor:
    """:func:`repetition_key_max_torch`'s scores from the Triton kernels (a GPU, or CPU tensors in Triton's
    interpreter). Queries are read in the keys' dtype (the model's: bfloat16 or float16 operands, float32 sums)."""
    if jit.triton is None:
        raise RuntimeError("the repetition scores' kernels need Triton")
    _check(queries, keys, context, start, stop, sinks)
    if not keys.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the repetition scores' Triton kernels read {keys.device.type} tensors only in Triton's interpreter "
                         "(TRITON_INTERPRET=1); on a CPU score with backend='torch'")
    batch, q_heads, fed, dim = queries.shape
    heads, length = keys.shape[1], keys.shape[2]
    rows = q_heads // heads * fed
    q = queries.to(keys.dtype).reshape(batch * heads, rows, dim).contiguous()  # row r: query head r // F, token r % F
    k = keys.reshape(batch * heads, length, dim).contiguous()
    if not k.is_cuda:  # Triton's interpreter multiplies half tiles wrong: their exact float32 values instead
        q, k = q.float(), k.float()
    n = stop - start
    lse = torch.empty(batch * heads, rows, dtype=torch.float32, device=keys.device)
    out = torch.empty(batch * heads, n, dtype=torch.float32, device=keys.device)
    row_tile, key_tile = (ROW_TILE, KEY_TILE) if dim <= 128 else (WIDE_TILE, WIDE_TILE)
    constants = dict(D=dim, BD=max(16, 1 << (dim - 1).bit_length()), BM=row_tile, BN=key_tile, IEEE=k.dtype == torch.float32)
    scale2 = float(scaling) * LOG2E
    jit._row_lse_kernel[(batch * heads, -(-rows // row_tile))](q, k, lse, rows, fed, sinks, start, n, context, length, scale2,
                                                              **constants)
    jit._key_max_kernel[(batch * heads, -(-n // key_tile))](q, k, lse, out, rows, start, n, length, scale2, **constants)
    return out.view(batch, heads, n)
