"""Relative error and real bits per element of the low-bit quantizers on keys and values.

Prints one table: for each quantizer (int4-group, kivi at 2 and 4 bits, channel-group at 2/3/4 bits with
0/1/2 outliers and uniform/normal levels, rotated-token at 2/3/4 bits) the bits per element computed from
the packed fields' real ``nbytes``, and the relative error ``||x - x_hat|| / ||x||`` over all layers and
heads of keys after the rotary embedding (as attention reads them), keys before it (what a pipeline with
``key_space = "pre-rope"`` stores) and values.

By default the K/V are synthetic with the structure real ones have (a few large-magnitude key channels,
some with an offset, heavy-tailed noise, keys rotated by a standard RoPE). With ``--model default`` (or any
model spec ``kvweave.tools.models.load_model`` accepts) they are the cache of a real forward over
``--tokens`` tokens of kvweave's docs, and a second table gives the attention-output error of key/value
quantizer pairs: the model's own queries of the last ``--queries`` positions attend (causally) over every
quantized key and value, against the exact ones (keys quantized before RoPE are rotated back first).

    python benchmarks/quantizer_error.py                  # synthetic
    python benchmarks/quantizer_error.py --model default  # SmolLM2-135M on the CPU (~1 min)
"""

from __future__ import annotations

import argparse
import glob
import math
from pathlib import Path

import torch

from kvweave.core.errors import ModelError
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.plugins.quantizers.kivi import KiviQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

ROOT = Path(__file__).resolve().parents[1]


# --- data ---------------------------------------------------------------------------------------------


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Llama-style RoPE of ``x`` [..., T, D] at positions 0..T-1."""
    tokens, width = x.shape[-2:]
    inv = theta ** (-torch.arange(0, width, 2, dtype=torch.float64) / width)
    angles = torch.arange(tokens, dtype=torch.float64)[:, None] * inv[None]
    angles = torch.cat((angles, angles), dim=-1)
    return (x * angles.cos() + _rotate_half(x) * angles.sin()).float()


def synthetic_kv(layers=4, heads=4, tokens=1024, width=64, seed=0) -> dict[str, torch.Tensor]:
    """Keys/values [L, H, T, D] with real-like structure: per-channel widths (log-normal), 4 large key
    channels per head (8-16x, two of them with an offset), Student-t (4 dof) noise, a smooth drift over
    tokens, a first token ("attention sink") of small norm; keys pre- and post-RoPE."""
    g = torch.Generator().manual_seed(seed)
    student = torch.distributions.StudentT(4.0)
    torch.manual_seed(seed)
    shape = (layers, heads, tokens, width)
    widths = torch.exp(0.5 * torch.randn(layers, heads, 1, width, generator=g))
    big = torch.rand(layers, heads, width, generator=g).argsort(dim=-1)[..., :4]
    boost = torch.ones(layers, heads, width).scatter_(-1, big, 8 + 8 * torch.rand(layers, heads, 4, generator=g))
    offset = torch.zeros(layers, heads, width).scatter_(-1, big[..., :2], 3 * torch.randn(layers, heads, 2, generator=g))
    drift = torch.cumsum(torch.randn(layers, heads, tokens, width, generator=g), dim=-2) / math.sqrt(tokens)
    keys = (student.sample(shape) + drift) * widths * boost.unsqueeze(-2) + (offset * boost).unsqueeze(-2)
    keys[..., 0, :] *= 0.3
    values = student.sample(shape) * torch.exp(0.3 * torch.randn(layers, heads, 1, width, generator=g))
    values[..., 0, :] *= 0.25
    return {"keys post-RoPE": apply_rope(keys), "keys pre-RoPE": keys, "values": values}


def model_kv(spec: str, tokens: int, query_count: int) -> dict[str, torch.Tensor]:
    """The cache of one forward of ``spec`` over ``tokens`` tokens of the docs: keys post/pre-RoPE and
    values [L, H, T, D], plus the post-RoPE queries of the last ``query_count`` positions [L, Hq, P, D]
    and the model's attention output there [L, Hq, P, D] (to check the recomputation)."""
    from transformers import DynamicCache

    from kvweave.engine import cache_kwargs
    from kvweave.engine.rotary import RotaryInverse
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(spec, device="cpu", progress=False)
    text = "\n\n".join(Path(p).read_text() for p in sorted(glob.glob(str(ROOT / "docs" / "*.md"))))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    ids = ids[:, : ids.shape[1] // 64 * 64]  # whole groups of 32 and 64 tokens
    layers = model.model.layers
    head_dim = model.config.head_dim if getattr(model.config, "head_dim", None) else model.config.hidden_size // model.config.num_attention_heads
    captured: dict[str, list] = {"q": [None] * len(layers), "o": [None] * len(layers)}

    def keep(kind, index):
        def hook(_module, args, output):
            tensor = output if kind == "q" else args[0]
            if tensor.dim() == 4:  # a q_norm's output: [B, Hq, T, D] (Gemma-3) or [B, T, Hq, D] (Qwen3); T is a multiple of 64
                heads = model.config.num_attention_heads
                captured[kind][index] = (tensor[0] if tensor.shape[1] == heads else tensor[0].transpose(0, 1)).float()
            else:
                captured[kind][index] = tensor[0].reshape(tensor.shape[1], -1, head_dim).transpose(0, 1).float()
        return hook

    # the queries as attention takes them: after a q_norm where the model has one (Gemma-3, Qwen3)
    handles = [getattr(layer.self_attn, "q_norm", layer.self_attn.q_proj).register_forward_hook(keep("q", i))
               for i, layer in enumerate(layers)]
    handles += [layer.self_attn.o_proj.register_forward_hook(keep("o", i)) for i, layer in enumerate(layers)]
    cache = DynamicCache()  # full layers everywhere: a sliding-window layer keeps every token too (its mask still applies)
    try:
        with torch.inference_mode():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    finally:
        for handle in handles:
            handle.remove()
    keys = torch.stack([layer.keys[0].float() for layer in cache.layers])
    values = torch.stack([layer.values[0].float() for layer in cache.layers])
    inverse = RotaryInverse.from_model(model, head_dim, "quantizer_error")
    positions = torch.arange(keys.shape[-2])
    pre = torch.stack([inverse.unrotate(keys[i], i, positions) for i in range(len(layers))])
    last = positions[-query_count:]
    queries = torch.stack([inverse.rotate(captured["q"][i][:, -query_count:], i, last) for i in range(len(layers))])
    outputs = torch.stack([captured["o"][i][:, -query_count:] for i in range(len(layers))])
    # the mean square of each query channel over every position (a KV head's query heads summed): what a
    # cache accumulates from the context's own queries for channel-alloc's query_weight (engine/energy.py)
    group = captured["q"][0].shape[0] // keys.shape[1]
    energy = torch.stack([q.square().mean(dim=1).reshape(keys.shape[1], group, head_dim).sum(dim=1) for q in captured["q"]])
    types = getattr(model.config, "layer_types", None) or ["full_attention"] * len(layers)
    windows = [model.config.sliding_window if kind == "sliding_attention" else None for kind in types]
    return {"keys post-RoPE": keys, "keys pre-RoPE": pre, "values": values, "queries": queries,
            "outputs": outputs, "inverse": inverse, "scale": float(layers[0].self_attn.scaling), "energy": energy,
            "windows": windows}


# --- quantizers ---------------------------------------------------------------------------------------


def methods() -> list[tuple[str, object]]:
    """(label, quantizer or ``kivi`` factory) rows of the error table."""
    rows: list[tuple[str, object]] = [("int4-group g32", Int4GroupQuantizer(group=32))]
    rows += [(f"kivi-{bits} g32", KiviQuantizer(bits=bits, group=32, value_group=32)) for bits in (2, 4)]
    for bits in (2, 3, 4):
        for levels in ("uniform", "normal"):
            for outliers in (0, 1, 2):
                rows.append((f"channel-group {bits}b k{outliers} {levels}", ChannelGroupQuantizer(bits=bits, group=32, outliers=outliers, levels=levels)))
        rows.append((f"channel-group {bits}b k1 uniform g64", ChannelGroupQuantizer(bits=bits, group=64, outliers=1)))
    for bits in (2, 3, 4):
        rows.append((f"rotated-token {bits}b normal", RotatedTokenQuantizer(bits=bits)))
        rows.append((f"rotated-token {bits}b normal log8 scales", RotatedTokenQuantizer(bits=bits, scale_format="log8")))
        rows.append((f"rotated-token {bits}b uniform", RotatedTokenQuantizer(bits=bits, levels="uniform")))
        rows.append((f"rotated-token {bits}b uniform asym", RotatedTokenQuantizer(bits=bits, levels="uniform", symmetric=False)))
        rows.append((f"  (no rotation) {bits}b normal", RotatedTokenQuantizer(bits=bits, rotation="none")))
    return rows


def for_kind(quantizer, kind: str):
    return quantizer.for_kind("keys" if kind.startswith("keys") else "values")


def round_trip(quantizer, x: torch.Tensor, energy: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """``x_hat`` and the bits per element of the packed fields (from their nbytes); ``energy`` [..., C] the
    queries' energy per channel, for a quantizer that weighs channels by it."""
    weighted = getattr(quantizer, "uses_query_energy", False)
    packed = quantizer.quantize(x, channel_weights=energy) if weighted else quantizer.quantize(x)
    stored = sum(t.numel() * t.element_size() for t in packed.values())
    return quantizer.dequantize(packed, torch.float32), 8 * stored / x.numel()


def relative(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x - x_hat).norm() / x.norm())


def error_table(data: dict[str, torch.Tensor]) -> list[str]:
    kinds = ["keys post-RoPE", "keys pre-RoPE", "values"]
    lines = ["| quantizer | bits/elem K | bits/elem V | " + " | ".join(f"err {k}" for k in kinds) + " |",
             "|---|---:|---:|" + "---:|" * len(kinds)]
    for label, quantizer in methods():
        errors, bits = [], {}
        try:
            for kind in kinds:
                x_hat, bits[kind] = round_trip(for_kind(quantizer, kind), data[kind])
                errors.append(relative(data[kind], x_hat))
        except ModelError as exc:  # e.g. outlier channels stored as uint8 on a head of 256 channels
            lines.append(f"| {label} | - | - | refused: {exc} |" + " |" * (len(kinds) - 1))
            continue
        lines.append(f"| {label} | {bits['keys pre-RoPE']:.2f} | {bits['values']:.2f} | "
                     + " | ".join(f"{e:.4f}" for e in errors) + " |")
    return lines


# --- attention output (real model) --------------------------------------------------------------------


def attention(queries, keys, values, scale, windows=None) -> torch.Tensor:
    """Causal attention of the last P positions: queries [L, Hq, P, D] over keys/values [L, H, T, D];
    ``windows`` (one per layer, None for full attention) limits a sliding-window layer to its last tokens."""
    repeat = queries.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(repeat, dim=1), values.repeat_interleave(repeat, dim=1)
    logits = queries @ keys.transpose(-1, -2) * scale
    tokens, count = keys.shape[-2], queries.shape[-2]
    distance = torch.arange(tokens - count, tokens)[:, None] - torch.arange(tokens)[None, :]  # [P, T]
    allowed = (distance >= 0).expand(len(keys), -1, -1).clone()
    for layer, window in enumerate(windows or []):
        if window is not None:
            allowed[layer] &= distance < window
    return torch.softmax(logits.masked_fill(~allowed[:, None], -torch.inf), dim=-1) @ values


def attention_pairs() -> list[tuple[str, object, bool, object]]:
    """(label, key quantizer, keys pre-RoPE?, value quantizer); cg = channel-group, rt = rotated-token, ca = channel-alloc
    (defaults: cg 3 bits, 1 outlier, uniform, group 32; rt 2 bits, normal levels, symmetric, group 64)."""
    cg, rt, ca = ChannelGroupQuantizer, RotatedTokenQuantizer, ChannelAllocQuantizer
    kivi2, kivi4 = KiviQuantizer(bits=2), KiviQuantizer(bits=4)
    return [
        ("int4-group / int4-group", Int4GroupQuantizer(), False, Int4GroupQuantizer()),
        ("kivi-4", kivi4.for_kind("keys"), False, kivi4.for_kind("values")),
        ("kivi-2", kivi2.for_kind("keys"), False, kivi2.for_kind("values")),
        ("cg 2b k1 uniform pre-RoPE / rt 2b", cg(bits=2), True, rt(bits=2)),
        ("cg 2b k1 normal pre-RoPE / rt 2b", cg(bits=2, levels="normal"), True, rt(bits=2)),
        ("cg 2b k2 uniform pre-RoPE / rt 2b", cg(bits=2, outliers=2), True, rt(bits=2)),
        ("cg 3b k0 pre-RoPE / rt 2b", cg(outliers=0), True, rt(bits=2)),
        ("cg 3b k1 post-RoPE / rt 2b", cg(), False, rt(bits=2)),
        ("**cg 3b k1 pre-RoPE / rt 2b (defaults)**", cg(), True, rt()),
        ("cg 3b k1 pre-RoPE / rt 2b uniform", cg(), True, rt(levels="uniform")),
        ("cg 3b k1 pre-RoPE / rt 2b uniform asym", cg(), True, rt(levels="uniform", symmetric=False)),
        ("cg 3b k1 pre-RoPE / 2b normal, no rotation", cg(), True, rt(rotation="none")),
        ("cg 3b k1 pre-RoPE / kivi-2 values", cg(), True, kivi2.for_kind("values")),
        ("cg 3b k2 pre-RoPE / rt 2b", cg(outliers=2), True, rt()),
        ("cg 3b k1 pre-RoPE / rt 3b", cg(), True, rt(bits=3)),
        ("cg 4b k1 pre-RoPE / rt 4b", cg(bits=4), True, rt(bits=4)),
        ("rt 3b keys pre-RoPE / rt 3b", rt(bits=3), True, rt(bits=3)),
        # the frontier pipelines' keys (group 64): uniform widths against widths allocated by range
        ("cg 3b k1 g64 pre-RoPE / rt 2b (prerope-k3v2)", cg(group=64), True, rt()),
        ("cg 4b k1 g64 pre-RoPE / rt 2b (prerope-k4v2)", cg(bits=4, group=64), True, rt()),
        ("ca 3.0b k0 pre-RoPE / rt 2b (prerope-a3v2)", ca(mean_bits=3.0, outliers=0), True, rt()),
        ("ca 3.0b k1 pre-RoPE / rt 2b", ca(mean_bits=3.0, outliers=1), True, rt()),
        ("ca 3.25b k0 pre-RoPE / rt 2b (prerope-a325v2)", ca(mean_bits=3.25, outliers=0), True, rt()),
        ("ca 3.5b k0 pre-RoPE / rt 2b (prerope-a35v2)", ca(mean_bits=3.5, outliers=0), True, rt()),
        ("ca 3.5b k0 pre-RoPE, no pairs / rt 2b", ca(mean_bits=3.5, outliers=0, pairs=False), True, rt()),
        ("ca 3.5b k0 post-RoPE, no pairs / rt 2b", ca(mean_bits=3.5, outliers=0, pairs=False), False, rt()),
        # channels weighed by the energy of the model's queries (query_weight), and 3-bit values
        ("ca 3.0b k0 pre-RoPE, query_weight 0.5 / rt 2b (prerope-qa3v2)", ca(mean_bits=3.0, outliers=0, query_weight=0.5), True, rt()),
        ("ca 3.0b k0 pre-RoPE, query_weight 1.0 / rt 2b", ca(mean_bits=3.0, outliers=0, query_weight=1.0), True, rt()),
        ("ca 3.5b k0 pre-RoPE, query_weight 0.5 / rt 3b (prerope-qa35v3)", ca(mean_bits=3.5, outliers=0, query_weight=0.5), True, rt(bits=3)),
        # the dense kernel's storage (benchmarks/dense_sweep.toml's kzd-k4v2 codes): keys after RoPE, log8 value scales
        ("cg 4b k0 g64 post-RoPE / rt 2b log8 (kzd-k4v2)", cg(bits=4, group=64, outliers=0), False, rt(scale_format="log8")),
        ("cg 4b k0 g64 post-RoPE / rt 4b uniform log8", cg(bits=4, group=64, outliers=0), False,
         rt(bits=4, levels="uniform", scale_format="log8")),
        # the same keys in groups of 128 tokens: half the scales, which the dense kernel folds once a group
        # (docs/kernels.md "What a step of the dense kernel issues")
        ("cg 4b k0 g128 post-RoPE / rt 2b log8", cg(bits=4, group=128, outliers=0), False, rt(scale_format="log8")),
        ("cg 4b k0 g128 post-RoPE / rt 4b uniform log8", cg(bits=4, group=128, outliers=0), False,
         rt(bits=4, levels="uniform", scale_format="log8")),
    ]


def attention_table(data) -> list[str]:
    windows = data.get("windows")
    exact = attention(data["queries"], data["keys post-RoPE"], data["values"], data["scale"], windows)
    check = relative(data["outputs"], exact)
    lines = [f"attention recomputed from the cache vs the model's own output: relative difference {check:.1e}", "",
             "| keys / values | bits/elem K+V | x less than 16-bit | attn err K only | attn err V only | attn err both |",
             "|---|---:|---:|---:|---:|---:|"]
    for label, key_quantizer, pre_rope, value_quantizer in attention_pairs():
        try:
            row = _attention_row(data, key_quantizer, pre_rope, value_quantizer, exact, windows)
        except ModelError as exc:
            lines.append(f"| {label} | - | - | refused: {exc} | | |")
            continue
        lines.append(f"| {label} | " + row + " |")
    # the sinks router's effect: the first position restored exactly (its float16 residual), bits unchanged
    for label, key_quantizer, pre_rope, value_quantizer in attention_pairs():
        if label.endswith(("(prerope-qa3v2)", "(prerope-qa35v3)")):
            row = _attention_row(data, key_quantizer, pre_rope, value_quantizer, exact, windows, sinks=1)
            lines.append(f"| {label}, first position restored (sinks) | " + row + " |")
    return lines


def _attention_row(data, key_quantizer, pre_rope: bool, value_quantizer, exact, windows, sinks: int = 0) -> str:
    """Bits, ratio and the three attention-output errors of one key/value quantizer pair; ``sinks``: the first
    positions put back exactly after quantization (their residual's bytes are not counted)."""
    queries, scale, inverse = data["queries"], data["scale"], data["inverse"]
    keys, pre, values = data["keys post-RoPE"], data["keys pre-RoPE"], data["values"]
    positions = torch.arange(keys.shape[-2])
    if pre_rope:
        stored, key_bits = round_trip(key_quantizer, pre, data["energy"])
        stored[..., :sinks, :] = pre[..., :sinks, :]
        key_hat = torch.stack([inverse.rotate(stored[i], i, positions) for i in range(len(stored))])
    else:
        key_hat, key_bits = round_trip(key_quantizer, keys, data["energy"])
        key_hat[..., :sinks, :] = keys[..., :sinks, :]
    value_hat, value_bits = round_trip(value_quantizer, values)
    value_hat[..., :sinks, :] = values[..., :sinks, :]
    errors = [relative(exact, attention(queries, k, v, scale, windows)) for k, v in ((key_hat, values), (keys, value_hat), (key_hat, value_hat))]
    total = key_bits + value_bits
    return f"{total:.2f} | {32 / total:.2f} | " + " | ".join(f"{e:.4f}" for e in errors)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a model spec (e.g. 'default'); synthetic K/V when omitted")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of the real forward (a multiple of 64)")
    parser.add_argument("--queries", type=int, default=128, help="last positions whose attention output is compared")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic K/V")
    args = parser.parse_args(argv)
    torch.set_num_threads(min(2, torch.get_num_threads()))
    if args.model is None:
        data = synthetic_kv(seed=args.seed)
        print(f"synthetic K/V {tuple(data['values'].shape)} [layers, heads, tokens, head_dim], seed {args.seed}\n")
    else:
        data = model_kv(args.model, args.tokens, args.queries)
        print(f"model {args.model!r}: K/V {tuple(data['values'].shape)} [layers, KV heads, tokens, head_dim]\n")
    print("\n".join(error_table(data)))
    if args.model is not None:
        print()
        print("\n".join(attention_table(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
