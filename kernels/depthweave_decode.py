"""Decode attention straight from DepthWeave-KV's packed storage: the Triton kernel and its torch twin.

One new query token per sequence attends over one layer's cache, which holds

- packed tokens ``0 .. T-1``: int8 coefficients ``c_t`` [r] with float16 scales per ``block`` channels,
  decoded by the basis version ``v(t)`` their block was encoded with: ``k_t = c_t P_v`` (``P_v`` [r, D] is
  this layer's column block of the window's token-factor basis);
- routed residuals: for some tokens, the first ``rho`` coordinates ``e_t`` (int4, one float16 scale per
  ``group``) on the layer's residual basis ``R`` [rho_max, D], weighted by the head's gate ``g``;
- the exact recent window (model dtype), at logical positions ``T .. T+W-1``.

So, with ``q`` pre-scaled, ``score_t = (q P_v^T) . c_t + g (q R^T)[:rho] . e_t`` and the output is
``sum_v (sum_{t in v} p_t c_t) P_v + (sum_t p_t g e_t) R + sum_w p_w v_w``: the kernel reads the int8
and int4 bytes, dequantizes them in registers and never writes a key or value vector to memory.

Work split (flash-decoding): the packed tokens are cut into segments that each lie inside one basis
version (``segments`` [S, 3] int32: start, end, version; starts multiples of ``TILE``), one program per
(segment, batch row x KV head) keeps an online softmax for the ``Hq / H`` query heads that share the KV
head (GQA) and writes a partial (max, sum, output); the exact window is one more partial; a combine pass
merges them. A token's residual entry is found through the list's tile index: per (row, 32-token tile)
the first entry and a bit mask of the tokens that have one, so the entry of token ``32 j + i`` is
``start + popcount(mask & (2^i - 1))``, read with no search and no scatter.

Rows of a batch may hold different numbers of real tokens (left padding): ``start`` [B] int32 is the
first logical position each row attends to.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch

from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer

try:  # the kernel needs triton; the torch twin does not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency on Linux
    triton = None
    tl = None

TILE = 32  # tokens per kernel tile = per residual tile-index entry
MAX_LEVELS = 3  # residual rank levels (> 0) the kernel takes
LOG2E = 1.4426950408889634


@attrs.frozen
class ResidualLevel:
    """One rank level's residual entries of one layer and kind (see :mod:`kvweave.engine.residuals`)."""

    rank: int
    group: int  # int4 channels per scale at this rank
    token: torch.Tensor  # int32 [N] packed-token index
    row: torch.Tensor  # int32 [N] b * H + h
    packed: torch.Tensor  # uint8 [N, rank / 2]
    scales: torch.Tensor  # float16 [N, rank / group]
    tile_start: torch.Tensor  # int32 [B * H, tiles]: first entry of each (row, 32-token tile)
    tile_mask: torch.Tensor  # int32 [B * H, tiles]: bit i set when token 32 * tile + i has an entry


@attrs.frozen
class DecodeView:
    """Everything one layer's decode attention reads, as views of the stored tensors (no copies)."""

    packed_tokens: int
    k_codes: torch.Tensor  # int8 [B, H, T, r]
    k_scales: torch.Tensor  # float16 [B, H, T, r / block]
    v_codes: torch.Tensor
    v_scales: torch.Tensor
    k_bases: torch.Tensor  # float16 [B, H, V, r, D] (a column view of the window's bases)
    v_bases: torch.Tensor
    segments: torch.Tensor  # int32 [S, 3] on the device: start, end, version
    k_levels: tuple[ResidualLevel, ...]
    v_levels: tuple[ResidualLevel, ...]
    k_residual_basis: torch.Tensor | None  # float16 [B, H, R, D]
    v_residual_basis: torch.Tensor | None
    k_gates: torch.Tensor | None  # float32 [H]
    v_gates: torch.Tensor | None
    exact_k: torch.Tensor  # [B, H, W, D] model dtype
    exact_v: torch.Tensor

    @property
    def block(self) -> int:
        return self.k_codes.shape[-1] // self.k_scales.shape[-1]


def version_segments(version_tokens: list[int], split: int, device: torch.device) -> torch.Tensor:
    """Cut tokens ``0 .. sum(version_tokens)`` into segments of at most ``split`` tokens that never cross a
    version boundary; ``split`` and every version's token count must be multiples of :data:`TILE`."""
    rows, start = [], 0
    for version, count in enumerate(version_tokens):
        end = start + count
        for lo in range(start, end, split):
            rows.append((lo, min(lo + split, end), version))
        start = end
    if not rows:
        return torch.zeros(0, 3, dtype=torch.int32, device=device)
    return torch.tensor(rows, dtype=torch.int32, device=device)


def choose_split(tokens: int, programs_per_token_split: int, target_programs: int = 1056, max_split: int = 2048) -> int:
    """Tokens per segment: enough programs to fill the GPU (about ``target_programs`` for all rows and
    heads), at least 256 and at most ``max_split`` tokens each, a multiple of :data:`TILE`. The cap keeps
    many programs in flight at large batches: one program per SM slot leaves the last wave nearly empty
    (on the H200 at 128K tokens, B = 8: 1,088 programs of 7,712 tokens 1,460 us, 4,096 of 2,048 945 us;
    ``benchmarks/kernel_tuning.py``)."""
    if tokens <= 0:
        return 256
    splits = max(1, math.ceil(target_programs / max(1, programs_per_token_split)))
    split = min(max(256, math.ceil(tokens / splits)), max_split)
    return math.ceil(split / TILE) * TILE


# --------------------------------------------------------------------------------------------- torch twin
def _dequant_int4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return Int4GroupQuantizer().dequantize({"packed": packed, "scales": scales}, torch.float32)  # groups from the shapes


def _dequant_int8(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return Int8BlockQuantizer().dequantize({"codes": codes, "scales": scales}, torch.float32)  # blocks from the shapes


def _token_versions(view: DecodeView, device: torch.device) -> torch.Tensor:
    version = torch.zeros(view.packed_tokens, dtype=torch.long, device=device)
    for lo, hi, v in view.segments.tolist():
        version[lo:hi] = v
    return version


def _packed_logits(view: DecodeView, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores [B, H, G, T] of pre-scaled queries ``q`` [B, H, G, D] on the packed tokens, in coefficient
    space (residual coordinates included), and each token's basis version [T]."""
    batch, heads, gq, _ = q.shape
    tokens = view.packed_tokens
    version = _token_versions(view, q.device)
    c_k = _dequant_int8(view.k_codes, view.k_scales)  # [B, H, T, r]
    qp = torch.einsum("bhgd,bhvrd->bhgvr", q, view.k_bases.float())  # [B, H, G, V, r]
    logits = torch.einsum("bhgtr,bhtr->bhgt", qp[:, :, :, version, :], c_k)
    if view.k_levels:
        qr = torch.einsum("bhgd,bhkd->bhgk", q, view.k_residual_basis.float())  # [B, H, G, R]
        flat = logits.permute(0, 1, 3, 2).reshape(batch * heads * tokens, gq)
        for level in view.k_levels:
            if level.token.numel() == 0:
                continue
            e = _dequant_int4(level.packed, level.scales)  # [N, rho]
            row = level.row.long()
            if view.k_gates is not None:
                e = e * view.k_gates.float()[row % heads, None]
            delta = torch.einsum("ngk,nk->ng", qr.reshape(batch * heads, gq, -1)[row, :, : level.rank], e)
            flat.index_add_(0, row * tokens + level.token.long(), delta)
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

    ``query`` [B, Hq, D] -> output [B, Hq, D] in the query's dtype. Used on devices without the kernel
    and as the reference of the kernel tests."""
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    q = query.float().reshape(batch, heads, gq, dim) * scale
    device = query.device
    tokens = view.packed_tokens
    pos_exact = tokens + torch.arange(view.exact_k.shape[-2], device=device)
    logits_exact = torch.einsum("bhgd,bhwd->bhgw", q, view.exact_k.float())
    parts = [logits_exact]
    if tokens:
        logits, version = _packed_logits(view, q)
        c_v = _dequant_int8(view.v_codes, view.v_scales)
        parts.insert(0, logits)
        positions = torch.cat((torch.arange(tokens, device=device), pos_exact))
    else:
        positions = pos_exact
    scores = torch.cat(parts, dim=-1)  # [B, H, G, T + W]
    if start is not None:
        scores = scores.masked_fill(positions[None, None, None, :] < start.to(device).long()[:, None, None, None], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)
    p_packed, p_exact = probs[..., :tokens], probs[..., tokens:]
    out = torch.einsum("bhgw,bhwd->bhgd", p_exact, view.exact_v.float())
    if tokens:
        versions = view.v_bases.shape[2]
        weights = torch.einsum("bhgt,bhtr->bhgtr", p_packed, c_v)
        acc = weights.new_zeros(batch, heads, gq, versions, weights.shape[-1]).index_add_(3, version, weights)
        out = out + torch.einsum("bhgvr,bhvrd->bhgd", acc, view.v_bases.float())
        if view.v_levels:
            rank_max = view.v_residual_basis.shape[-2]
            acc_r = out.new_zeros(batch * heads, gq, rank_max)
            flat_p = p_packed.permute(0, 1, 3, 2).reshape(batch * heads * tokens, gq)
            for level in view.v_levels:
                if level.token.numel() == 0:
                    continue
                e = _dequant_int4(level.packed, level.scales)
                row = level.row.long()
                if view.v_gates is not None:
                    e = e * view.v_gates.float()[row % heads, None]
                pe = flat_p[row * tokens + level.token.long()]  # [N, G]
                acc_r[:, :, : level.rank].index_add_(0, row, torch.einsum("ng,nk->ngk", pe, e))
            out = out + torch.einsum("bhgk,bhkd->bhgd", acc_r.reshape(batch, heads, gq, rank_max), view.v_residual_basis.float())
    return out.reshape(batch, q_heads, dim).to(query.dtype)


# ----------------------------------------------------------------------------------------------- triton
if triton is not None:

    @triton.jit
    def _popcount(x):
        """Set bits of each uint32 in ``x``."""
        x = x - ((x >> 1) & 0x55555555)
        x = (x & 0x33333333) + ((x >> 2) & 0x33333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F
        return (x * 0x01010101) >> 24

    @triton.jit
    def _level_values(pk_ptr, sc_ptr, ts_ptr, tm_ptr, row, tiles, tok, inside,
                      RANK: tl.constexpr, GROUP: tl.constexpr, RP: tl.constexpr, BLOCK_T: tl.constexpr):
        """One level's residual coordinates of tokens ``tok`` [T] as float16 [T, RP]: coordinate ``k`` in
        column ``k * RP / RANK`` (zeros between; see :func:`_level_rows`), zero for tokens without an entry.
        The tile index gives each token's entry directly: ``start + popcount(mask & (2^i - 1))``."""
        tile = tok // 32
        bit = tok % 32
        first = tl.load(ts_ptr + row * tiles + tile, mask=inside, other=0)
        mask = tl.load(tm_ptr + row * tiles + tile, mask=inside, other=0).to(tl.uint32, bitcast=True)
        present = inside & (((mask >> bit.to(tl.uint32)) & 1) != 0)
        below = (((1 << bit) - 1).to(tl.uint32, bitcast=True)) & mask
        entry = (first + _popcount(below).to(tl.int32)).to(tl.int64)
        c = tl.arange(0, RP)
        step: tl.constexpr = RP // RANK
        k = c // step  # the coordinate column c holds (when step divides c)
        used = present[:, None] & ((c % step) == 0)[None, :]
        byte = tl.load(pk_ptr + entry[:, None] * (RANK // 2) + (k // 2)[None, :], mask=used, other=136).to(tl.int32)
        code = ((byte >> ((k % 2) * 4)[None, :]) & 15) - 8
        scale = tl.load(sc_ptr + entry[:, None] * (RANK // GROUP) + (k // GROUP)[None, :], mask=used, other=0.0)
        values = tl.where(used, code.to(tl.float32) * scale.to(tl.float32), 0.0).to(tl.float16)
        return values

    @triton.jit
    def _level_rows(base_ptr, stride_r, RANK: tl.constexpr, RP: tl.constexpr, D: tl.constexpr):
        """The residual basis rows of one level laid out as :func:`_level_values` lays out coordinates:
        column ``c`` holds row ``c * RANK / RP`` when ``RP / RANK`` divides ``c``, else zeros. [RP, D] float32."""
        c = tl.arange(0, RP)
        d = tl.arange(0, D)
        step = RP // RANK
        used = (c % step) == 0
        return tl.load(base_ptr + (c // step)[:, None] * stride_r + d[None, :], mask=used[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _codes(c_ptr, tok, inside, c_st, R: tl.constexpr, RC: tl.constexpr):
        """int8 coefficient codes [T, RC] of tokens ``tok`` as float16 (exact), zero beyond R and outside."""
        r = tl.arange(0, RC)
        if R == RC:
            codes = tl.load(c_ptr + tok[:, None] * c_st + r[None, :], mask=inside[:, None], other=0)
        else:
            codes = tl.load(c_ptr + tok[:, None] * c_st + r[None, :], mask=inside[:, None] & (r < R)[None, :], other=0)
        return codes.to(tl.float16)

    @triton.jit
    def _block_scales(s_ptr, tok, inside, s_st, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr):
        """Per-channel scales [T, RC] (float16) for coefficients with several scale blocks per token."""
        r = tl.arange(0, RC)
        return tl.load(s_ptr + tok[:, None] * s_st + (r // RB)[None, :], mask=inside[:, None] & (r < R)[None, :], other=0.0).to(tl.float16)

    @triton.jit
    def _rows(base_ptr, stride_r, R: tl.constexpr, RC: tl.constexpr, D: tl.constexpr):
        """The first R rows of a basis [R, D] (row stride ``stride_r``), zero-padded to RC rows, float32."""
        r = tl.arange(0, RC)
        d = tl.arange(0, D)
        return tl.load(base_ptr + r[:, None] * stride_r + d[None, :], mask=(r < R)[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _packed_split_kernel(
        q_ptr, seg_ptr, start_ptr,
        kc_ptr, ks_ptr, vc_ptr, vs_ptr, c_sb, c_sh, c_st, s_sb, s_sh, s_st,
        kb_ptr, vb_ptr, b_sb, b_sh, b_sv, b_sr,
        krb_ptr, vrb_ptr, rb_sb, rb_sh, rb_sr, kg_ptr, vg_ptr,
        k0_pk, k0_sc, k0_ts, k0_tm, k1_pk, k1_sc, k1_ts, k1_tm, k2_pk, k2_sc, k2_ts, k2_tm,
        v0_pk, v0_sc, v0_ts, v0_tm, v1_pk, v1_sc, v1_ts, v1_tm, v2_pk, v2_sc, v2_ts, v2_tm,
        m_ptr, l_ptr, acc_ptr, partials, H, tiles, qk_scale,
        GQ: tl.constexpr, GQP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, RC: tl.constexpr, RB: tl.constexpr,
        RP: tl.constexpr,
        RANK0: tl.constexpr, GROUP0: tl.constexpr, RANK1: tl.constexpr, GROUP1: tl.constexpr,
        RANK2: tl.constexpr, GROUP2: tl.constexpr,
        K_GATES: tl.constexpr, V_GATES: tl.constexpr, BLOCK_T: tl.constexpr,
    ):
        seg = tl.program_id(0)
        bh = tl.program_id(1)
        b = bh // H
        h = bh % H
        lo = tl.load(seg_ptr + seg * 3)
        hi = tl.load(seg_ptr + seg * 3 + 1)
        version = tl.load(seg_ptr + seg * 3 + 2)
        first_valid = tl.load(start_ptr + b)
        ONE_SCALE: tl.constexpr = RB >= R  # one scale per token: applied to the dot products, codes stay exact

        g = tl.arange(0, GQP)
        t = tl.arange(0, BLOCK_T)
        g_ok = g < GQ
        b64 = b.to(tl.int64)
        k_gate = 1.0
        v_gate = 1.0
        if K_GATES:
            k_gate = tl.load(kg_ptr + h)
        if V_GATES:
            v_gate = tl.load(vg_ptr + h)
        # q in coefficient space: q P_v^T [GQP, RC]; per residual level q R^T in that level's column layout
        # (D in chunks of 32 columns, so that no [GQP, D] tile is held)
        q_row = q_ptr + (bh * GQ + g)[:, None] * D
        kb = kb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        krb = krb_ptr + b64 * rb_sb + h * rb_sh
        qp = tl.zeros((GQP, RC), dtype=tl.float32)
        qr0 = tl.zeros((GQP, RP), dtype=tl.float32)
        qr1 = tl.zeros((GQP, RP), dtype=tl.float32)
        qr2 = tl.zeros((GQP, RP), dtype=tl.float32)
        for d0 in tl.static_range(0, D, 32):
            dc = d0 + tl.arange(0, 32)
            qc = (tl.load(q_row + dc[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale).to(tl.float16)
            qp += tl.dot(qc, tl.trans(_rows(kb + d0, b_sr, R, RC, 32).to(tl.float16)))
            if RANK0 > 0:
                qr0 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK0, RP, 32).to(tl.float16)))
            if RANK1 > 0:
                qr1 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK1, RP, 32).to(tl.float16)))
            if RANK2 > 0:
                qr2 += tl.dot(qc, tl.trans(_level_rows(krb + d0, rb_sr, RANK2, RP, 32).to(tl.float16)))
        qp = qp.to(tl.float16)
        qr0 = (qr0 * k_gate).to(tl.float16)
        qr1 = (qr1 * k_gate).to(tl.float16)
        qr2 = (qr2 * k_gate).to(tl.float16)
        acc_r0 = tl.zeros((GQP, RP), dtype=tl.float32)
        acc_r1 = tl.zeros((GQP, RP), dtype=tl.float32)
        acc_r2 = tl.zeros((GQP, RP), dtype=tl.float32)

        m_i = tl.full((GQP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((GQP,), dtype=tl.float32)
        acc_c = tl.zeros((GQP, RC), dtype=tl.float32)
        kc = kc_ptr + b64 * c_sb + h * c_sh
        vc = vc_ptr + b64 * c_sb + h * c_sh
        ks = ks_ptr + b64 * s_sb + h * s_sh
        vs = vs_ptr + b64 * s_sb + h * s_sh
        for t0 in range(lo, hi, BLOCK_T):
            tok = t0 + t
            inside = tok < hi
            ok = inside & (tok >= first_valid)
            ck = _codes(kc, tok, inside, c_st, R, RC)  # [T, RC] float16
            if ONE_SCALE:
                k_scale = tl.load(ks + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                s = tl.dot(qp, tl.trans(ck)) * k_scale[None, :]  # [GQP, T], float32 sums
            else:
                s = tl.dot(qp, tl.trans(ck * _block_scales(ks, tok, inside, s_st, R, RC, RB)))
            if RANK0 > 0:
                s += tl.dot(qr0, tl.trans(_level_values(k0_pk, k0_sc, k0_ts, k0_tm, bh, tiles, tok, inside, RANK0, GROUP0, RP, BLOCK_T)))
            if RANK1 > 0:
                s += tl.dot(qr1, tl.trans(_level_values(k1_pk, k1_sc, k1_ts, k1_tm, bh, tiles, tok, inside, RANK1, GROUP1, RP, BLOCK_T)))
            if RANK2 > 0:
                s += tl.dot(qr2, tl.trans(_level_values(k2_pk, k2_sc, k2_ts, k2_tm, bh, tiles, tok, inside, RANK2, GROUP2, RP, BLOCK_T)))
            s = tl.where(ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)  # [GQP, T]
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            p16 = p.to(tl.float16)
            cv = _codes(vc, tok, inside, c_st, R, RC)
            if ONE_SCALE:
                v_scale = tl.load(vs + tok * s_st, mask=inside, other=0.0).to(tl.float32)
                acc_c = acc_c * alpha[:, None] + tl.dot((p * v_scale[None, :]).to(tl.float16), cv)
            else:
                acc_c = acc_c * alpha[:, None] + tl.dot(p16, cv * _block_scales(vs, tok, inside, s_st, R, RC, RB))
            if RANK0 > 0:
                acc_r0 = acc_r0 * alpha[:, None] + tl.dot(p16, _level_values(v0_pk, v0_sc, v0_ts, v0_tm, bh, tiles, tok, inside, RANK0, GROUP0, RP, BLOCK_T))
            if RANK1 > 0:
                acc_r1 = acc_r1 * alpha[:, None] + tl.dot(p16, _level_values(v1_pk, v1_sc, v1_ts, v1_tm, bh, tiles, tok, inside, RANK1, GROUP1, RP, BLOCK_T))
            if RANK2 > 0:
                acc_r2 = acc_r2 * alpha[:, None] + tl.dot(p16, _level_values(v2_pk, v2_sc, v2_ts, v2_tm, bh, tiles, tok, inside, RANK2, GROUP2, RP, BLOCK_T))

        # back to head_dim: (sum p c) P_v + per level (sum p g e) R, 32 columns at a time
        vb = vb_ptr + b64 * b_sb + h * b_sh + version * b_sv
        vrb = vrb_ptr + b64 * rb_sb + h * rb_sh
        acc_c16 = acc_c.to(tl.float16)
        acc_r0 = (acc_r0 * v_gate).to(tl.float16)
        acc_r1 = (acc_r1 * v_gate).to(tl.float16)
        acc_r2 = (acc_r2 * v_gate).to(tl.float16)
        slot = (bh * GQ + g) * partials + seg
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, l_i, mask=g_ok)
        for d0 in tl.static_range(0, D, 32):
            dc = d0 + tl.arange(0, 32)
            out = tl.dot(acc_c16, _rows(vb + d0, b_sr, R, RC, 32).to(tl.float16))  # [GQP, 32]
            if RANK0 > 0:
                out += tl.dot(acc_r0, _level_rows(vrb + d0, rb_sr, RANK0, RP, 32).to(tl.float16))
            if RANK1 > 0:
                out += tl.dot(acc_r1, _level_rows(vrb + d0, rb_sr, RANK1, RP, 32).to(tl.float16))
            if RANK2 > 0:
                out += tl.dot(acc_r2, _level_rows(vrb + d0, rb_sr, RANK2, RP, 32).to(tl.float16))
            tl.store(acc_ptr + slot[:, None] * D + dc[None, :], out, mask=g_ok[:, None])

    @triton.jit
    def _exact_split_kernel(
        q_ptr, start_ptr, ek_ptr, ev_ptr, e_sb, e_sh, e_st, window, offset,
        m_ptr, l_ptr, acc_ptr, partials, slot_index, H, qk_scale,
        GQ: tl.constexpr, GQP: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
    ):
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        g = tl.arange(0, GQP)
        d = tl.arange(0, D)
        w = tl.arange(0, BLOCK)
        g_ok = g < GQ
        first_valid = tl.load(start_ptr + b)
        q = tl.load(q_ptr + (bh * GQ + g)[:, None] * D + d[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32) * qk_scale
        m_i = tl.full((GQP,), -1.0e30, dtype=tl.float32)
        l_i = tl.zeros((GQP,), dtype=tl.float32)
        acc = tl.zeros((GQP, D), dtype=tl.float32)
        base = b.to(tl.int64) * e_sb + h * e_sh
        for w0 in range(0, window, BLOCK):
            idx = w0 + w
            inside = idx < window
            ok = inside & (offset + idx >= first_valid)
            keys = tl.load(ek_ptr + base + idx[:, None] * e_st + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(keys), input_precision="tf32x3")  # [GQP, BLOCK]
            s = tl.where(ok[None, :], s, -1.0e30)
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.where(ok[None, :], tl.exp2(s - m_new[:, None]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
            vals = tl.load(ev_ptr + base + idx[:, None] * e_st + d[None, :], mask=inside[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p, vals, input_precision="tf32x3")
        slot = (bh * GQ + g) * partials + slot_index
        tl.store(m_ptr + slot, m_i, mask=g_ok)
        tl.store(l_ptr + slot, l_i, mask=g_ok)
        tl.store(acc_ptr + slot[:, None] * D + d[None, :], acc, mask=g_ok[:, None])

    @triton.jit
    def _combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, partials, D: tl.constexpr, CHUNK: tl.constexpr):
        row = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        d = tl.arange(0, D)
        top = tl.full((CHUNK,), -1.0e30, dtype=tl.float32)
        for c0 in range(0, partials, CHUNK):
            top = tl.maximum(top, tl.load(m_ptr + row * partials + c0 + c, mask=c0 + c < partials, other=-1.0e30))
        big = tl.max(top, axis=0)
        total = tl.zeros((CHUNK,), dtype=tl.float32)
        acc = tl.zeros((D,), dtype=tl.float32)
        for c0 in range(0, partials, CHUNK):
            inside = c0 + c < partials
            m = tl.load(m_ptr + row * partials + c0 + c, mask=inside, other=-1.0e30)
            weight = tl.where(inside, tl.exp2(m - big), 0.0)
            total += weight * tl.load(l_ptr + row * partials + c0 + c, mask=inside, other=0.0)
            part = tl.load(acc_ptr + (row * partials + c0 + c)[:, None] * D + d[None, :], mask=inside[:, None], other=0.0)
            acc += tl.sum(weight[:, None] * part, axis=0)
        denominator = tl.sum(total, axis=0)
        result = tl.where(denominator > 0, acc / tl.where(denominator > 0, denominator, 1.0), 0.0)
        tl.store(out_ptr + row * D + d, result.to(out_ptr.dtype.element_ty))


_PLACEHOLDERS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def placeholder(device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A one-element tensor of ``dtype`` on ``device``, made once: what a kernel argument points to when its
    input is absent (a missing residual level, no gates), so decode steps launch no kernel to make one."""
    key = (torch.device(device), dtype)
    if key not in _PLACEHOLDERS:
        _PLACEHOLDERS[key] = torch.zeros(1, dtype=dtype, device=device)
    return _PLACEHOLDERS[key]


def _pow2(n: int, least: int = 2) -> int:
    return max(least, 1 << max(0, (int(n) - 1).bit_length()))


def check_view(view: DecodeView, query: torch.Tensor) -> None:
    """Raise ValueError naming the first input the kernel cannot take."""
    if query.dim() != 3:
        raise ValueError(f"query must be [B, Hq, D], got {tuple(query.shape)}")
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    if q_heads % heads:
        raise ValueError(f"{q_heads} query heads are not a multiple of {heads} KV heads")
    if dim & (dim - 1) or dim < 32:
        raise ValueError(f"head_dim {dim} must be a power of two of at least 32 (64, 128 and 256 are tested)")
    if view.exact_k.shape[0] != batch or view.exact_k.shape[-1] != dim:
        raise ValueError(f"query {tuple(query.shape)} does not match the exact window {tuple(view.exact_k.shape)}")
    if view.packed_tokens:
        rank = view.k_codes.shape[-1]
        if rank > 64:
            raise ValueError(f"coefficient rank {rank} is above the kernel's 64")
        if view.k_codes.stride() != view.v_codes.stride() or view.k_scales.stride() != view.v_scales.stride():
            raise ValueError("key and value coefficients must share one layout")
        if view.k_codes.stride(-1) != 1 or view.k_scales.stride(-1) != 1 or view.k_bases.stride(-1) != 1:
            raise ValueError("coefficients, scales and bases must be contiguous along their last dimension")
        if view.k_bases.stride() != view.v_bases.stride():
            raise ValueError("key and value bases must share one layout")
        if len(view.k_levels) > MAX_LEVELS or len(view.k_levels) != len(view.v_levels):
            raise ValueError(f"the kernel takes at most {MAX_LEVELS} residual levels, the same for keys and values")
        if view.packed_tokens % TILE:
            raise ValueError(f"packed tokens ({view.packed_tokens}) must be a multiple of {TILE}")


def _prepare(view: DecodeView, query: torch.Tensor, partials: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check the inputs; the partial (max, sum, output) buffers of ``partials`` slots per query head."""
    if triton is None:
        raise RuntimeError("the fused DepthWeave-KV kernel needs triton (pip install triton)")
    check_view(view, query)
    batch, q_heads, dim = query.shape
    m = torch.empty(batch * q_heads * partials, dtype=torch.float32, device=query.device)
    return m, torch.empty_like(m), torch.empty(batch * q_heads * partials, dim, dtype=torch.float32, device=query.device)


def fused_decode(
    view: DecodeView, query: torch.Tensor, start: torch.Tensor | None, scale: float, split: int | None = None,
    block_tokens: int = 64, num_warps: int = 1, num_stages: int | None = 1,
) -> torch.Tensor:
    """The Triton kernel: ``query`` [B, Hq, D] -> [B, Hq, D] (query dtype). ``split``: tokens per segment
    (default: the view's segments); ``block_tokens``: tokens per loop iteration (a multiple of 32);
    ``num_stages``: Triton's software-pipelining depth for the packed-token loop (None: Triton's default, 3;
    1, no pipelining, was 10 % faster on the H200 at 128K tokens: ``benchmarks/kernel_tuning.py --stages``)."""
    batch, q_heads, dim = query.shape
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    device = query.device
    query = query.contiguous()
    if start is None:
        start = torch.zeros(batch, dtype=torch.int32, device=device)
    start = start.to(device=device, dtype=torch.int32).contiguous()
    tokens = view.packed_tokens
    segments = view.segments
    if tokens and split is not None:
        segments = resplit(view.segments, split)
    n_seg = segments.shape[0] if tokens else 0
    partials = n_seg + 1
    m, l, acc = _prepare(view, query, partials)
    qk_scale = float(scale) * LOG2E
    if n_seg:
        _launch_packed(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block_tokens, num_warps, num_stages)
    exact = view.exact_k
    if exact.stride(-1) != 1 or exact.stride() != view.exact_v.stride():
        raise ValueError("the exact window's keys and values must share one layout, contiguous along head_dim")
    _exact_split_kernel[(batch * heads,)](
        query, start, exact, view.exact_v, exact.stride(0), exact.stride(1), exact.stride(2), exact.shape[-2], tokens,
        m, l, acc, partials, n_seg, heads, qk_scale,
        GQ=gq, GQP=_pow2(gq, 16), D=dim, BLOCK=32,
    )
    out = torch.empty(batch, q_heads, dim, dtype=query.dtype, device=device)
    _combine_kernel[(batch * q_heads,)](m, l, acc, out, partials, D=dim, CHUNK=16)
    return out


def fused_packed_logsumexp(
    view: DecodeView, query: torch.Tensor, scale: float, block_tokens: int = 64, num_warps: int = 1, num_stages: int | None = 1,
) -> torch.Tensor:
    """:func:`torch_packed_logsumexp` by the kernel's packed-token pass: its per-segment (max, sum) merged."""
    batch, q_heads, dim = query.shape
    n_seg = view.segments.shape[0] if view.packed_tokens else 0
    m, l, acc = _prepare(view, query, n_seg)
    if not n_seg:
        return query.new_full((batch, q_heads), float("-inf"), dtype=torch.float32)
    heads = view.exact_k.shape[1]
    gq = q_heads // heads
    start = torch.zeros(batch, dtype=torch.int32, device=query.device)
    _launch_packed(view, query.contiguous(), view.segments, start, m, l, acc, n_seg, heads, gq, dim,
                   float(scale) * LOG2E, block_tokens, num_warps, num_stages)
    m, l = m.view(batch, q_heads, n_seg), l.view(batch, q_heads, n_seg)
    top = m.amax(dim=-1, keepdim=True)
    total = (l * torch.exp2(m - top)).sum(dim=-1)
    return torch.where(total > 0, (top.squeeze(-1) + torch.log2(total)) / LOG2E, float("-inf"))


def resplit(segments: torch.Tensor, split: int) -> torch.Tensor:
    """The tokens of ``segments`` [S, 3] cut again, per version, into segments of at most ``split`` tokens
    (tests and benchmarks; a view's own segments are cut when the cache is read)."""
    counts = torch.zeros(int(segments[:, 2].max()) + 1, dtype=torch.long)
    for lo, hi, version in segments.tolist():
        counts[version] += hi - lo
    return version_segments(counts.tolist(), split, segments.device)


def _level_args(levels: tuple[ResidualLevel, ...], dummy: torch.Tensor) -> tuple[list[Any], list[int]]:
    args: list[Any] = []
    meta: list[int] = []
    for i in range(MAX_LEVELS):
        if i < len(levels):
            lv = levels[i]
            args += [lv.packed, lv.scales, lv.tile_start, lv.tile_mask]
            meta += [lv.rank, lv.group]
        else:
            args += [dummy] * 4
            meta += [0, 2]
    return args, meta


def _launch_packed(view, query, segments, start, m, l, acc, partials, heads, gq, dim, qk_scale, block_tokens, num_warps, num_stages=None) -> None:
    """Launch the packed-token pass over ``segments``, writing partial (max, sum, output) slots
    ``(row * gq + g) * partials + segment`` of ``m``, ``l``, ``acc``."""
    batch = query.shape[0]
    rank = view.k_codes.shape[-1]
    block = view.block
    dummy = placeholder(query.device)
    k_args, k_meta = _level_args(view.k_levels, dummy)
    v_args, v_meta = _level_args(view.v_levels, dummy)
    for i, (a, b) in enumerate(zip(view.k_levels, view.v_levels)):
        if a.rank != b.rank or a.group != b.group:
            raise ValueError(f"residual level {i}: keys have rank {a.rank}/group {a.group}, values {b.rank}/{b.group}")
    levels = [rank_ for rank_ in k_meta[0::2] if rank_]
    if view.k_levels:
        rb = view.k_residual_basis
        if rb is None or view.v_residual_basis is None:
            raise ValueError("residual levels need the residual bases of keys and values")
        if rb.stride() != view.v_residual_basis.stride() or rb.stride(-1) != 1:
            raise ValueError("key and value residual bases must share one layout, contiguous along head_dim")
        rr = rb.shape[-2]
        if max(levels) > rr:
            raise ValueError(f"a residual level of rank {max(levels)} exceeds the residual basis rank {rr}")
        rb_strides = (rb.stride(0), rb.stride(1), rb.stride(2))
        krb, vrb = rb, view.v_residual_basis
    else:
        rr, krb, vrb, rb_strides = 1, dummy, dummy, (0, 0, 0)
    tiles = view.packed_tokens // TILE
    kg = view.k_gates if view.k_gates is not None else dummy
    vg = view.v_gates if view.v_gates is not None else dummy
    kc, ks = view.k_codes, view.k_scales
    kb = view.k_bases
    grid = (segments.shape[0], batch * heads)
    _packed_split_kernel[grid](
        query, segments, start,
        kc, ks, view.v_codes, view.v_scales, kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1), ks.stride(2),
        kb, view.v_bases, kb.stride(0), kb.stride(1), kb.stride(2), kb.stride(3),
        krb, vrb, *rb_strides, kg, vg,
        *k_args, *v_args,
        m, l, acc, partials, heads, tiles, qk_scale,
        GQ=gq, GQP=_pow2(gq, 16), D=dim, R=rank, RC=_pow2(rank, 16), RB=block, RP=_pow2(max(levels, default=1), 16),
        RANK0=k_meta[0], GROUP0=k_meta[1], RANK1=k_meta[2], GROUP1=k_meta[3], RANK2=k_meta[4], GROUP2=k_meta[5],
        K_GATES=view.k_gates is not None, V_GATES=view.v_gates is not None, BLOCK_T=block_tokens,
        num_warps=num_warps, **({} if num_stages is None else {"num_stages": num_stages}),
    )
