"""The decode kernel's torch twin: the same coefficient-space computation in float32.

Used where the Triton kernel does not run (``backend = "auto"`` off CUDA, ``backend = "torch"``) and as
the reference of the kernel tests. It unpacks ``int8-block.v1`` coefficients and ``int4-group.v1``
residual coordinates with :mod:`kvweave.kernels.formats`; see :mod:`kvweave.kernels.depthweave_decode`
for what is computed.

Shapes: ``B`` batch, ``Hq`` query heads, ``H`` KV heads, ``G = Hq / H``, ``T`` packed tokens, ``r``
coefficient rank, ``V`` basis versions, ``R`` residual basis rank, ``W`` exact tokens, ``D`` head dim.
"""

from __future__ import annotations

from kvweave.core.lazy import torch
from kvweave.kernels.decode_view import DecodeView
from kvweave.kernels.formats import dequantize_int4_group, dequantize_int8_block


def _token_versions(view: DecodeView, device: torch.device) -> torch.Tensor:
    """The basis version of every packed token, long [T]."""
    version = torch.zeros(view.packed_tokens, dtype=torch.long, device=device)
    for lo, hi, v in view.segments.tolist():
        version[lo:hi] = v
    return version


def _gated_entries(levels, gates: torch.Tensor | None, heads: int):
    """For each residual level with entries: the level, its gated values e [N, rho] (float32), and each
    entry's row ``b * H + h`` and packed-token index (long [N] each)."""
    for level in levels:
        if level.entries == 0:
            continue
        e = dequantize_int4_group(level.packed, level.scales)  # [N, rho]
        row, token = (t.long() for t in level.located())
        if gates is not None:
            e = e * gates.float()[row % heads, None]
        yield level, e, row, token


def _packed_logits(view: DecodeView, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B, H, G, T] of pre-scaled queries ``q`` [B, H, G, D] on the packed tokens, in coefficient
    space (residual coordinates included), and each token's basis version [T]."""
    batch, heads, gq, _ = q.shape
    tokens = view.packed_tokens
    version = _token_versions(view, q.device)
    c_k = dequantize_int8_block(view.k_codes, view.k_scales)  # [B, H, T, r]
    qp = torch.einsum("bhgd,bhvrd->bhgvr", q, view.k_bases.float())  # [B, H, G, V, r]
    logits = torch.einsum("bhgtr,bhtr->bhgt", qp[:, :, :, version, :], c_k)
    if view.k_levels:
        qr = torch.einsum("bhgd,bhkd->bhgk", q, view.k_residual_basis.float())  # [B, H, G, R]
        flat = logits.permute(0, 1, 3, 2).reshape(batch * heads * tokens, gq)
        for level, e, row, token in _gated_entries(view.k_levels, view.k_gates, heads):
            delta = torch.einsum("ngk,nk->ng", qr.reshape(batch * heads, gq, -1)[row, :, : level.rank], e)
            flat.index_add_(0, row * tokens + token, delta)
        logits = flat.reshape(batch, heads, tokens, gq).permute(0, 1, 3, 2)
    return logits, version


def torch_packed_logsumexp(view: DecodeView, query: torch.Tensor, scale: float) -> torch.Tensor:
    """log-sum-exp [B, Hq] of ``query`` [B, Hq, D] (times ``scale``) over the packed tokens only (-inf when
    there are none): the normalizer a router needs for attention probabilities, without keys in head_dim."""
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    if not view.packed_tokens:
        return query.new_full((batch, q_heads), float("-inf"), dtype=torch.float32)
    q = query.float().reshape(batch, heads, q_heads // heads, dim) * scale
    logits, _ = _packed_logits(view, q)
    return logits.logsumexp(dim=-1).reshape(batch, q_heads)


def torch_decode(view: DecodeView, query: torch.Tensor, start: torch.Tensor | None, scale: float) -> torch.Tensor:
    """The fused computation in torch, in coefficient space like the kernel (float32 throughout).

    ``query`` [B, Hq, D] -> output [B, Hq, D] in the query's dtype; ``start`` int32 [B] the first logical
    position each row attends to (None: 0)."""
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    q = query.float().reshape(batch, heads, gq, dim) * scale
    device = query.device
    tokens = view.packed_tokens
    exact_k, exact_v = view.exact_k, view.exact_v
    if view.exact_fill is not None:  # a window kept for a CUDA graph: its first fill + 1 rows
        rows = int(view.exact_fill.reshape(-1)[0]) + 1
        exact_k, exact_v = exact_k[..., :rows, :], exact_v[..., :rows, :]
    pos_exact = tokens + torch.arange(exact_k.shape[-2], device=device)
    logits_exact = torch.einsum("bhgd,bhwd->bhgw", q, exact_k.float())
    parts = [logits_exact]
    if tokens:
        logits, version = _packed_logits(view, q)
        c_v = dequantize_int8_block(view.v_codes, view.v_scales)
        parts.insert(0, logits)
        positions = torch.cat((torch.arange(tokens, device=device), pos_exact))
    else:
        positions = pos_exact
    scores = torch.cat(parts, dim=-1)  # [B, H, G, T + W]
    if start is not None:
        scores = scores.masked_fill(positions[None, None, None, :] < start.to(device).long()[:, None, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)
    p_packed, p_exact = probs[..., :tokens], probs[..., tokens:]
    out = torch.einsum("bhgw,bhwd->bhgd", p_exact, exact_v.float())
    if tokens:
        versions = view.v_bases.shape[2]
        weights = torch.einsum("bhgt,bhtr->bhgtr", p_packed, c_v)
        acc = weights.new_zeros(batch, heads, gq, versions, weights.shape[-1]).index_add_(3, version, weights)
        out = out + torch.einsum("bhgvr,bhvrd->bhgd", acc, view.v_bases.float())
        if view.v_levels:
            rank_max = view.v_residual_basis.shape[-2]
            acc_r = out.new_zeros(batch * heads, gq, rank_max)
            flat_p = p_packed.permute(0, 1, 3, 2).reshape(batch * heads * tokens, gq)
            for level, e, row, token in _gated_entries(view.v_levels, view.v_gates, heads):
                pe = flat_p[row * tokens + token]  # [N, G]
                acc_r[:, :, : level.rank].index_add_(0, row, torch.einsum("ng,nk->ngk", pe, e))
            out = out + torch.einsum("bhgk,bhkd->bhgd", acc_r.reshape(batch, heads, gq, rank_max), view.v_residual_basis.float())
    return out.reshape(batch, q_heads, dim).to(query.dtype)
