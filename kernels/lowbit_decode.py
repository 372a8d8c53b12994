"""Decode attention over low-bit keys and values read in place: keys per channel over token groups
(``channel-group.v1``: uniform codes, a float16 minimum and scale per channel and group, exact outliers),
stored before the rotary embedding and rotated in registers at each token's position, and values per token
after a fixed orthogonal rotation (``rotated-token.v1``: codes on a table of levels, a float16 scale per
group of channels), accumulated in the rotated space and rotated back once per query.

:func:`lowbit_decode` runs the Triton kernel (one program per batch row, KV head and split of the packed
tokens; each keeps a running max, sum and output, combined by the host), :func:`torch_lowbit_decode` is its
torch twin (the same arithmetic with whole tensors: the kernel's reference in the tests and the path on a
CPU). Both then merge the exact window (the recent tokens in the model's dtype) by their log-sum-exp.

Inputs (:class:`LowbitView`), ``BH`` = batch x KV heads, ``T`` packed tokens, ``D`` head dim:
``k_codes`` uint8 [BH, T, D * kbits / 8], ``k_zero``/``k_scale`` float16 [BH, T / kgroup, D],
``k_out_index`` uint8 / ``k_out_value`` float16 [BH, T, KO]; ``v_codes`` uint8 [BH, T, D * vbits / 8],
``v_scale`` float16 [BH, T, D / vgroup]; ``v_levels`` float32 [2 ** vbits] (the value of each code before
the scale), ``rotation`` float32 [D, D] (a stored value vector is ``y @ rotation``); ``inv_freq`` float32
[D / 2] and ``rope_scale`` (the rotary embedding's angles ``position * inv_freq``, cos and sin times
``rope_scale``; None: keys stored after it); ``first`` the logical position of packed token 0.
"""

from __future__ import annotations

import math

import attrs

from kvweave.core.lazy import torch

try:  # Triton is optional: the torch twin runs without it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

#: packed tokens per loop step of a program
BLOCK_T = 32


@attrs.frozen
class LowbitView:
    """One layer's packed low-bit storage as the kernel reads it (see the module docstring)."""

    tokens: int
    first: int
    k_codes: torch.Tensor
    k_zero: torch.Tensor
    k_scale: torch.Tensor
    k_out_index: torch.Tensor | None
    k_out_value: torch.Tensor | None
    k_bits: int
    k_group: int
    v_codes: torch.Tensor
    v_scale: torch.Tensor
    v_bits: int
    v_group: int
    v_levels: torch.Tensor
    rotation: torch.Tensor
    inv_freq: torch.Tensor | None
    rope_scale: float
    exact_k: torch.Tensor
    exact_v: torch.Tensor


def _codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., C * bits / 8] little-endian codes (2, 4 or 8 bits) -> int64 [..., C]."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device) * bits
    return ((packed.long().unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).flatten(-2)


def torch_keys(view: LowbitView) -> torch.Tensor:
    """The packed keys as attention reads them (rotated at their positions): float32 [BH, T, D]."""
    codes = _codes(view.k_codes, view.k_bits).float()
    bh, tokens, dim = codes.shape
    rows = torch.arange(tokens, device=codes.device) // view.k_group
    keys = view.k_zero.float()[:, rows] + codes * view.k_scale.float()[:, rows]
    if view.k_out_index is not None:
        keys = keys.scatter(-1, view.k_out_index.long(), view.k_out_value.float())
    if view.inv_freq is None:
        return keys
    positions = view.first + torch.arange(tokens, device=codes.device, dtype=torch.float32)
    angles = positions[:, None] * view.inv_freq[None, :].float()  # [T, D / 2]
    cos = torch.cat((angles.cos(), angles.cos()), -1) * view.rope_scale
    sin = torch.cat((angles.sin(), angles.sin()), -1) * view.rope_scale
    half = dim // 2
    partner = torch.cat((-keys[..., half:], keys[..., :half]), -1)
    return keys * cos + partner * sin


def torch_values(view: LowbitView) -> torch.Tensor:
    """The packed values in the rotated space (before ``rotation``): float32 [BH, T, D]."""
    codes = _codes(view.v_codes, view.v_bits)
    bh, tokens, dim = codes.shape
    levels = view.v_levels.float()[codes]
    scale = view.v_scale.float().repeat_interleave(view.v_group, dim=-1)
    return levels * scale


def _merge_exact(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float,
                 m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor) -> torch.Tensor:
    """Merge the packed part (running max ``m``, sum ``l``, un-normalised output ``acc`` in the original
    space, [B, Hq] / [B, Hq, D]) with attention over the exact window: [B, Hq, D] float32."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    group = q_heads // heads
    keys = view.exact_k.float().repeat_interleave(group, dim=1)  # [B, Hq, n, D]
    values = view.exact_v.float().repeat_interleave(group, dim=1)
    logits = torch.einsum("bhd,bhnd->bhn", q.float(), keys) * scaling
    if start is not None and keys.shape[-2]:
        positions = view.first + view.tokens + torch.arange(keys.shape[-2], device=q.device)
        logits = logits.masked_fill(positions[None, None, :] < start[:, None, None], -math.inf)
    m_e = logits.amax(-1) if logits.shape[-1] else torch.full_like(m, -math.inf)
    top = torch.maximum(m, m_e)
    top = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    w_p = torch.exp(m - top)
    p_e = torch.exp(logits - top[..., None])
    total = w_p * l + p_e.sum(-1)
    out = w_p[..., None] * acc + torch.einsum("bhn,bhnd->bhd", p_e, values)
    return out / total[..., None]


def torch_lowbit_decode(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Decode attention of ``q`` [B, Hq, D] over the packed tokens and the exact window: [B, Hq, D] float32
    (the kernel's torch twin)."""
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    group = q_heads // heads
    if view.tokens == 0:
        empty_m = torch.full((batch, q_heads), -math.inf, device=q.device)
        return _merge_exact(view, q, start, scaling, empty_m, torch.zeros_like(empty_m), q.new_zeros(batch, q_heads, dim).float())
    keys = torch_keys(view).reshape(batch, heads, view.tokens, dim).repeat_interleave(group, dim=1)
    values = torch_values(view).reshape(batch, heads, view.tokens, dim).repeat_interleave(group, dim=1)
    logits = torch.einsum("bhd,bhtd->bht", q.float(), keys) * scaling
    if start is not None:
        positions = view.first + torch.arange(view.tokens, device=q.device)
        logits = logits.masked_fill(positions[None, None, :] < start[:, None, None], -math.inf)
    m = logits.amax(-1)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(logits - safe[..., None])
    acc = torch.einsum("bht,bhtd->bhd", p, values) @ view.rotation
    return _merge_exact(view, q, start, scaling, safe.masked_fill(torch.isinf(m), -math.inf), p.sum(-1), acc)


if triton is not None:

    @triton.jit
    def _dequant(codes_ptr, zero_ptr, scale_ptr, oi_ptr, ov_ptr, row_off, t_idx, t_ok, chan,
                 D: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr):
        """Keys [BLOCK_T, D] (channel order ``chan``) of tokens ``t_idx``, before the rotary embedding."""
        per: tl.constexpr = 8 // KBITS
        width: tl.constexpr = D * KBITS // 8
        byte = tl.load(codes_ptr + row_off * width + t_idx[:, None] * width + (chan // per)[None, :], mask=t_ok[:, None], other=0)
        code = (byte.to(tl.int32) >> ((chan % per) * KBITS)[None, :]) & ((1 << KBITS) - 1)
        group_row = tl.min(t_idx) // KGROUP  # a tile lies within one token group (BLOCK divides KGROUP)
        zero = tl.load(zero_ptr + (row_off // KGROUP) * D + group_row * D + chan).to(tl.float32)
        scale = tl.load(scale_ptr + (row_off // KGROUP) * D + group_row * D + chan).to(tl.float32)
        keys = zero[None, :] + code.to(tl.float32) * scale[None, :]
        for o in tl.static_range(KO):
            index = tl.load(oi_ptr + row_off * KO + t_idx * KO + o, mask=t_ok, other=0).to(tl.int32)
            value = tl.load(ov_ptr + row_off * KO + t_idx * KO + o, mask=t_ok, other=0.0).to(tl.float32)
            keys = tl.where(index[:, None] == chan[None, :], value[:, None], keys)
        return keys

    @triton.jit
    def _lowbit_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_ptr, vlev_ptr, freq_ptr, start_ptr,
        m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, first, rope_scale, scaling,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, ROPE: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
        LOWP: tl.constexpr,
    ):
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        chan = tl.arange(0, D)
        half: tl.constexpr = D // 2
        partner = (chan + half) % D
        sign = tl.where(chan < half, -1.0, 1.0)
        gi = tl.arange(0, G)
        q = tl.load(q_ptr + bh * G * D + gi[:, None] * D + chan[None, :]).to(tl.float32) * scaling
        if ROPE:
            freq = tl.load(freq_ptr + chan % half)
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        m_i = tl.full([G], float("-inf"), tl.float32)
        l_i = tl.zeros([G], tl.float32)
        acc = tl.zeros([G, D], tl.float32)
        row_off = bh.to(tl.int64) * tokens  # 64-bit offsets: B x H x T x width passes 2**31 at long contexts
        v_per: tl.constexpr = 8 // VBITS
        v_width: tl.constexpr = D * VBITS // 8
        v_groups: tl.constexpr = D // VGROUP
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tokens)
        for t0 in range(lo, hi, BLOCK):
            t_idx = t0 + tl.arange(0, BLOCK)
            t_ok = t_idx < hi
            keys = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, row_off, t_idx, t_ok, chan, D, KBITS, KGROUP, KO)
            if ROPE:
                other = _dequant(kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, row_off, t_idx, t_ok, partner, D, KBITS, KGROUP, KO)
                angle = (first + t_idx).to(tl.float32)[:, None] * freq[None, :]
                # into [-pi, pi] before cos/sin (their large-argument path is slow): Cody-Waite with 2 pi =
                # 6.28125 + 0.00193530717958647 (k * 6.28125 exact in float32 for k < 2**15, 200K positions)
                turns = tl.floor(angle * 0.15915494309189535 + 0.5)
                angle = (angle - turns * 6.28125) - turns * 0.0019353071795864769
                keys = (keys * tl.cos(angle) + sign[None, :] * other * tl.sin(angle)) * rope_scale
            if LOWP:  # tensor cores: bfloat16 operands (what sdpa over bfloat16 keys computes), float32 sums
                s = tl.dot(q.to(tl.bfloat16), tl.trans(keys.to(tl.bfloat16)))  # [G, BLOCK]
            else:
                s = tl.dot(q, tl.trans(keys), input_precision="ieee")
            visible = t_ok
            if HAS_START:
                visible = visible & ((first + t_idx) >= start)
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            byte = tl.load(vc_ptr + row_off * v_width + t_idx[:, None] * v_width + (chan // v_per)[None, :], mask=t_ok[:, None], other=0)
            code = (byte.to(tl.int32) >> ((chan % v_per) * VBITS)[None, :]) & ((1 << VBITS) - 1)
            level = tl.load(vlev_ptr + code)
            vscale = tl.load(vs_ptr + row_off * v_groups + t_idx[:, None] * v_groups + (chan // VGROUP)[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            values = level * vscale
            if LOWP:
                acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), values.to(tl.bfloat16))
            else:
                acc = acc * alpha[:, None] + tl.dot(p, values, input_precision="ieee")
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + gi, m_i)
        tl.store(l_ptr + out + gi, l_i)
        tl.store(acc_ptr + out * D + gi[:, None] * D + chan[None, :], acc)


if triton is not None:

    @triton.jit
    def _key_sub(kc_row, kz_row, ks_row, koi_row, kov_row, t_loc, t_ok, byte_idx, chan,
                 R: tl.constexpr, KBITS: tl.constexpr, WIDTH: tl.constexpr, D: tl.constexpr, KO: tl.constexpr):
        """Sub-tile ``R`` of a key tile: channels ``chan`` (= byte * per + R) from bytes ``byte_idx`` [NB]."""
        byte = tl.load(kc_row + t_loc[:, None] * WIDTH + byte_idx[None, :], mask=t_ok[:, None], other=0)
        code = (byte.to(tl.int32) >> (R * KBITS)) & ((1 << KBITS) - 1)
        zero = tl.load(kz_row + chan).to(tl.float32)
        scale = tl.load(ks_row + chan).to(tl.float32)
        keys = zero[None, :] + code.to(tl.float32) * scale[None, :]
        for o in tl.static_range(KO):
            index = tl.load(koi_row + t_loc * KO + o, mask=t_ok, other=0).to(tl.int32)
            value = tl.load(kov_row + t_loc * KO + o, mask=t_ok, other=0.0).to(tl.float32)
            keys = tl.where(index[:, None] == chan[None, :], value[:, None], keys)
        return keys

    @triton.jit
    def _value_sub(vc_row, vs_row, vlev_ptr, t_loc, t_ok, j, R: tl.constexpr, VBITS: tl.constexpr, VWIDTH: tl.constexpr,
                   VGROUPS: tl.constexpr, VGROUP: tl.constexpr, LEVELS: tl.constexpr, l0, l1):
        """Sub-tile ``R`` of a value tile (rotated space): channels ``j * per + R``."""
        per: tl.constexpr = 8 // VBITS
        byte = tl.load(vc_row + t_loc[:, None] * VWIDTH + j[None, :], mask=t_ok[:, None], other=0)
        code = (byte.to(tl.int32) >> (R * VBITS)) & ((1 << VBITS) - 1)
        if LEVELS == 1:  # uniform, symmetric: code - (2**bits - 1) / 2
            level = code.to(tl.float32) - ((1 << VBITS) - 1) / 2
        elif LEVELS == 2:  # the four normal levels -l1, -l0, l0, l1
            level = tl.where(code >= 2, 1.0, -1.0) * tl.where((code == 0) | (code == 3), l1, l0)
        else:
            level = tl.load(vlev_ptr + code)
        scale = tl.load(vs_row + t_loc[:, None] * VGROUPS + ((j * per + R) // VGROUP)[None, :], mask=t_ok[:, None], other=0.0)
        return level * scale.to(tl.float32)

    @triton.jit
    def _lowbit_fast_kernel(
        q_ptr, kc_ptr, kz_ptr, ks_ptr, koi_ptr, kov_ptr, vc_ptr, vs_ptr, vlev_ptr, freq_ptr, start_ptr,
        m_ptr, l_ptr, acc_ptr,
        tokens, heads, splits, split_len, first, rope_scale, scaling, l0, l1,
        D: tl.constexpr, G: tl.constexpr, KBITS: tl.constexpr, KGROUP: tl.constexpr, KO: tl.constexpr,
        VBITS: tl.constexpr, VGROUP: tl.constexpr, ROPE: tl.constexpr, HAS_START: tl.constexpr, BLOCK: tl.constexpr,
        LOWP: tl.constexpr, LEVELS: tl.constexpr,
    ):
        """The kernel with each tile split into sub-tiles of channels ``byte * per + r`` taken straight from the
        packed bytes (no per-element gather), each half of the head dequantized once and rotated pairwise."""
        bh = tl.program_id(0)
        split = tl.program_id(1)
        batch = bh // heads
        KP: tl.constexpr = 8 // KBITS
        VP: tl.constexpr = 8 // VBITS
        HALF: tl.constexpr = D // 2
        NB: tl.constexpr = HALF // KP  # bytes of a half-head of keys
        NV: tl.constexpr = D // VP  # bytes of a value
        KWIDTH: tl.constexpr = D * KBITS // 8
        VGROUPS: tl.constexpr = D // VGROUP
        gi = tl.arange(0, G)
        jb = tl.arange(0, NB)
        jv = tl.arange(0, NV)
        start = 0
        if HAS_START:
            start = tl.load(start_ptr + batch)
        row = bh.to(tl.int64) * tokens
        q_row = q_ptr + bh.to(tl.int64) * G * D
        lo = split * split_len
        hi = tl.minimum(lo + split_len, tokens)
        m_i = tl.full([G], float("-inf"), tl.float32)
        l_i = tl.zeros([G], tl.float32)
        acc0 = tl.zeros([G, NV], tl.float32)
        acc1 = tl.zeros([G, NV], tl.float32)
        acc2 = tl.zeros([G, NV], tl.float32)
        acc3 = tl.zeros([G, NV], tl.float32)
        for t0 in range(lo, hi, BLOCK):
            t_loc = tl.arange(0, BLOCK)
            t_ok = t0 + t_loc < hi
            kc_row = kc_ptr + (row + t0) * KWIDTH
            kz_row = kz_ptr + (row + t0) // KGROUP * D  # a tile lies within one token group
            ks_row = ks_ptr + (row + t0) // KGROUP * D
            koi_row = koi_ptr + (row + t0) * KO
            kov_row = kov_ptr + (row + t0) * KO
            s = tl.zeros([G, BLOCK], tl.float32)
            for r in tl.static_range(KP):
                chan_lo = jb * KP + r
                chan_hi = chan_lo + HALF
                k_lo = _key_sub(kc_row, kz_row, ks_row, koi_row, kov_row, t_loc, t_ok, jb, chan_lo, r, KBITS, KWIDTH, D, KO)
                k_hi = _key_sub(kc_row, kz_row, ks_row, koi_row, kov_row, t_loc, t_ok, jb + NB, chan_hi, r, KBITS, KWIDTH, D, KO)
                if ROPE:
                    freq = tl.load(freq_ptr + chan_lo)
                    angle = (first + t0 + t_loc).to(tl.float32)[:, None] * freq[None, :]
                    turns = tl.floor(angle * 0.15915494309189535 + 0.5)
                    angle = (angle - turns * 6.28125) - turns * 0.0019353071795864769
                    cos = tl.cos(angle) * rope_scale
                    sin = tl.sin(angle) * rope_scale
                    k_lo, k_hi = k_lo * cos - k_hi * sin, k_hi * cos + k_lo * sin
                q_lo = tl.load(q_row + gi[:, None] * D + chan_lo[None, :]) * scaling
                q_hi = tl.load(q_row + gi[:, None] * D + chan_hi[None, :]) * scaling
                if LOWP:
                    s += tl.dot(q_lo.to(tl.bfloat16), tl.trans(k_lo.to(tl.bfloat16)))
                    s += tl.dot(q_hi.to(tl.bfloat16), tl.trans(k_hi.to(tl.bfloat16)))
                else:
                    s += tl.dot(q_lo, tl.trans(k_lo), input_precision="ieee")
                    s += tl.dot(q_hi, tl.trans(k_hi), input_precision="ieee")
            visible = t_ok
            if HAS_START:
                visible = visible & ((first + t0 + t_loc) >= start)
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            vc_row = vc_ptr + (row + t0) * NV
            vs_row = vs_ptr + (row + t0) * VGROUPS
            pl = p.to(tl.bfloat16) if LOWP else p
            for r in tl.static_range(VP):
                v = _value_sub(vc_row, vs_row, vlev_ptr, t_loc, t_ok, jv, r, VBITS, NV, VGROUPS, VGROUP, LEVELS, l0, l1)
                if LOWP:
                    part = tl.dot(pl, v.to(tl.bfloat16))
                else:
                    part = tl.dot(pl, v, input_precision="ieee")
                if r == 0:
                    acc0 = acc0 * alpha[:, None] + part
                elif r == 1:
                    acc1 = acc1 * alpha[:, None] + part
                elif r == 2:
                    acc2 = acc2 * alpha[:, None] + part
                else:
                    acc3 = acc3 * alpha[:, None] + part
        out = (bh * splits + split) * G
        tl.store(m_ptr + out + gi, m_i)
        tl.store(l_ptr + out + gi, l_i)
        base = acc_ptr + out.to(tl.int64) * D + gi[:, None] * D
        tl.store(base + (jv * VP)[None, :], acc0)
        tl.store(base + (jv * VP + 1)[None, :], acc1)
        if VP > 2:
            tl.store(base + (jv * VP + 2)[None, :], acc2)
            tl.store(base + (jv * VP + 3)[None, :], acc3)


def fast_path(view: LowbitView) -> bool:
    """Whether the sub-tile kernel reads ``view``: tile products need 16 channels a sub-tile."""
    dim = view.exact_k.shape[-1]
    return (dim // 2) // (8 // view.k_bits) >= 16 and dim // (8 // view.v_bits) >= 16


def _levels_kind(view: LowbitView) -> tuple[int, float, float]:
    """How the fast kernel makes value levels: 1 uniform symmetric, 2 the four normal levels, 0 a table."""
    levels = view.v_levels.tolist() if view.v_levels.device.type == "cpu" else None
    count = 1 << view.v_bits
    if levels is None:
        levels = view.v_levels.cpu().tolist()
    uniform = [code - (count - 1) / 2 for code in range(count)]
    if all(abs(a - b) < 1e-7 for a, b in zip(levels, uniform)):
        return 1, 0.0, 0.0
    if count == 4 and abs(levels[0] + levels[3]) < 1e-7 and abs(levels[1] + levels[2]) < 1e-7:
        return 2, float(levels[2]), float(levels[3])
    return 0, 0.0, 0.0


def choose_splits(tokens: int, programs: int, target: int = 264) -> int:
    """Splits of the packed tokens per (row, head) so that about ``target`` programs run (>= BLOCK_T tokens each)."""
    most = max(1, -(-tokens // BLOCK_T))
    return max(1, min(most, -(-target // max(1, programs))))


def lowbit_decode(view: LowbitView, q: torch.Tensor, start: torch.Tensor | None, scaling: float,
                  block: int = 16, num_warps: int = 4, fast: bool = True) -> torch.Tensor:
    """The Triton path of :func:`torch_lowbit_decode`: [B, Hq, D] float32. On a GPU the two products of
    each tile take bfloat16 operands (float32 sums), as sdpa over the reference path's bfloat16 keys does;
    under ``TRITON_INTERPRET=1`` they stay float32, so the tests compare it with the twin closely."""
    if triton is None:
        raise RuntimeError("the lowbit kernel needs Triton; use backend 'torch'")
    batch, q_heads, dim = q.shape
    heads = view.exact_k.shape[1]
    group = q_heads // heads
    if view.tokens == 0:
        return torch_lowbit_decode(view, q, start, scaling)
    rows = max(16, triton.next_power_of_2(group))  # tensor-core tiles take 16 rows
    padded = q.new_zeros(batch * heads, rows, dim, dtype=torch.float32)
    padded[:, :group] = q.float().reshape(batch * heads, group, dim)
    splits = choose_splits(view.tokens, batch * heads)
    split_len = -(-view.tokens // splits)
    if view.k_group % block:
        raise ValueError(f"the lowbit kernel's tile of {block} tokens must divide the keys' token group {view.k_group}")
    split_len = -(-split_len // view.k_group) * view.k_group  # splits start on a token group
    splits = -(-view.tokens // split_len)
    m = torch.empty(batch * heads, splits, rows, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(batch * heads, splits, rows, dim, device=q.device)
    ko = 0 if view.k_out_index is None else view.k_out_index.shape[-1]
    dummy = view.k_zero
    args = (
        padded, view.k_codes, view.k_zero, view.k_scale,
        view.k_out_index if ko else dummy, view.k_out_value if ko else dummy,
        view.v_codes, view.v_scale, view.v_levels, view.inv_freq if view.inv_freq is not None else view.v_levels,
        start if start is not None else m, m, l, acc,
        view.tokens, heads, splits, split_len, view.first, float(view.rope_scale), float(scaling),
    )
    constants = dict(
        D=dim, G=rows, KBITS=view.k_bits, KGROUP=view.k_group, KO=ko, VBITS=view.v_bits, VGROUP=view.v_group,
        ROPE=view.inv_freq is not None, HAS_START=start is not None, BLOCK=block, LOWP=q.is_cuda, num_warps=num_warps,
    )
    if fast and fast_path(view):
        kind, l0, l1 = _levels_kind(view)
        _lowbit_fast_kernel[(batch * heads, splits)](*args, l0, l1, LEVELS=kind, **constants)
    else:
        _lowbit_kernel[(batch * heads, splits)](*args, **constants)
    top = m.amax(1)  # [BH, rows]
    safe = torch.where(torch.isinf(top), torch.zeros_like(top), top)
    weight = torch.exp(m - safe[:, None])
    total = (weight * l).sum(1)
    out = ((weight[..., None] * acc).sum(1) @ view.rotation)[:, :group]  # [BH, group, D], original space
    top = top[:, :group].reshape(batch, q_heads)
    return _merge_exact(view, q, start, scaling, top, total[:, :group].reshape(batch, q_heads),
                        out.reshape(batch, q_heads, dim))
