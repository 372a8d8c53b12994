"""Decode attention alone: the ``lowbit`` kernel (prerope-k4v2's storage: 4-bit pre-RoPE keys per channel
with one exact outlier, 2-bit rotated values; ``--storage qa35v3``: channel-alloc keys and 3-bit values with log8
scales; ``kz5`` / ``kz8``: a layer of the shipped KVzip pipelines, ``kvzip-qa35v3`` / ``kvzip-qa3-vl25-smollm2``,
their share of the context's tokens kept) against SDPA over a full bf16 cache of every token.

    python benchmarks/lowbit_kernel.py [--tokens 32768,65536,131072] [--batches 1,8,32]
        [--configs wide:32:4,general:16:4:528,wide:32:4:528:magic+vb16] [--post-rope] [--as-generate]
        [--shape llama3-8b|d256] [--cold-l2] [--out DIR]

``--as-generate`` launches it as ``model.generate`` did over a sinks + KVzip pipeline until the sinks became a first
visible position of the packed pass (``LowbitView.hidden_below``): each row's first visible position and a list of 4
hidden slots a row, which cost the ``dense`` kernel 11-19% (docs/kernels.md "Value codes as operand pairs").

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128, rope theta 500000), one new query
token per sequence; ``--shape d256``: 16 query heads on 8 KV heads at head_dim 256 (Gemma-2-9B's, Gemma-3-12B's).
The packed storage is written by the real quantizers (``channel-group`` 4-bit, group 64, one outlier;
``rotated-token`` 2-bit, normal levels) from random keys and values; the exact window holds 16 tokens. Reported per (T, B) and kernel configuration (``variant:block:warps[:programs[:tricks]]``, the Triton kernels
of ``kvweave.kernels.lowbit_decode.VARIANTS``, tricks "+"-separated names of its ``TRICKS``): SDPA and kernel GPU time (the kernels' device time from the torch
profiler per call, combine and exact-window merge included, and of it the combine's; host time left out), the kernel's
wall time per call (CUDA events, host included), speed-up on GPU time, both timed again as 20 calls replayed from a CUDA
graph (``decode_kernel.graph_us``: the gaps between kernels in, a combine launched before the packed pass ends counted
once) and that speed-up, the bytes the kernel reads (``nbytes`` of every packed
tensor and the exact window), the bandwidth that implies and its share of the measured copy bandwidth, the
bytes ratio against the bf16 cache; before that, each configuration's largest difference from the torch twin
(T = 4096) and the compiled kernel's registers and spills. A table on stdout, JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F

from decode_kernel import (copy_bandwidth, device_us, device_us_parts, graph_us, read_in_turn,  # the fused
                           timed)  # kernel's benchmark's timing
from bench_model import SHAPES as MODEL_SHAPES, attention_shape
from kvweave.kernels.lowbit_decode import (TRICKS, VARIANTS, LowbitView, level_kind, lowbit_decode, plan_launch,
                                           torch_lowbit_decode)
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer, rotation_matrix

#: the attention shapes ``--shape`` names, those of the benchmarks' models (``bench_model.SHAPES``): (query heads, KV
#: heads, head_dim, rope theta). "llama3-8b" is the default; "d256" has head_dim 256 (Gemma-2-9B's and Gemma-3-12B's
#: attention: 16 query heads on 8 KV heads)
SHAPES = {name: attention_shape(name) for name in MODEL_SHAPES}
Q_HEADS, KV_HEADS, HEAD_DIM, THETA = SHAPES["llama3-8b"]
WINDOW = 16


#: the storages the benchmark packs, by name: (key quantizer, value quantizer, share of the context's tokens kept).
#: "k4v2": prerope-k4v2's (4-bit channel-group keys with one outlier, 2-bit values, float16 scales); "qa35v3":
#: channel-alloc keys at 3.5 bits a channel on average with one outlier, 3-bit values with one-byte log8 scales;
#: "kz5": a layer of kvzip-qa35v3 that is not kept whole (its keys without outliers, 77% of the tokens kept at
#: random positions, each slot's position read with it); "kz8": one of kvzip-qa3-vl25-smollm2's 2-bit value layers
#: (3.0-bit keys, 48% kept); "k4v2e48": 4-bit channel-group keys without outliers and 2-bit log8 values, 48% kept
#: (the whole-byte storage of the ~8x class that the "dense" kernel reads, with --post-rope), "k4v2e48t" the same with
#: its value codes in tiles of 64 tokens (token_tiles = 64, read by the dense kernel only); "k4v4e77": the same keys
#: with 4-bit uniform log8 values, 77% kept (benchmarks/dense_sweep.toml's kzd-k4v4-f77, the ~5x class), "k4v4e77t" the
#: same with its value codes in tiles; "k4g128v2e48t" the 8x class's storage with its keys' scales and zero points over
#: groups of 128 tokens (4 bytes a token fewer); "k4v2e40t" / "k4v4e40t": the two kinds of layer of
#: benchmarks/dense_sweep.toml's kzd-k4vq25-f40 (40% kept, 2-bit values or 4-bit uniform ones, in tiles; 8 of its 30
#: layers are the second kind: benchmarks/layer_mix.py weighs the two)
STORAGES = {
    "k4v2": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=1), lambda: RotatedTokenQuantizer(bits=2), 1.0),
    "qa35v3": (lambda: ChannelAllocQuantizer(mean_bits=3.5, group=64, outliers=1),
               lambda: RotatedTokenQuantizer(bits=3, scale_format="log8"), 1.0),
    "kz5": (lambda: ChannelAllocQuantizer(mean_bits=3.5, group=64, outliers=0),
            lambda: RotatedTokenQuantizer(bits=3, scale_format="log8"), 0.77),
    "kz8": (lambda: ChannelAllocQuantizer(mean_bits=3.0, group=64, outliers=0),
            lambda: RotatedTokenQuantizer(bits=2, scale_format="log8"), 0.48),
    "k4v2e48": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                lambda: RotatedTokenQuantizer(bits=2, scale_format="log8"), 0.48),
    "k4v2e48t": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                 lambda: RotatedTokenQuantizer(bits=2, scale_format="log8", token_tiles=64), 0.48),
    "k4g128v2e48t": (lambda: ChannelGroupQuantizer(bits=4, group=128, outliers=0),
                     lambda: RotatedTokenQuantizer(bits=2, scale_format="log8", token_tiles=64), 0.48),
    "k4v2e40t": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                 lambda: RotatedTokenQuantizer(bits=2, scale_format="log8", token_tiles=64), 0.40),
    "k4v4e40t": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                 lambda: RotatedTokenQuantizer(bits=4, levels="uniform", scale_format="log8", token_tiles=64), 0.40),
    "k4v4e77t": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                 lambda: RotatedTokenQuantizer(bits=4, levels="uniform", scale_format="log8", token_tiles=64), 0.77),
    "k4v4e77": (lambda: ChannelGroupQuantizer(bits=4, group=64, outliers=0),
                lambda: RotatedTokenQuantizer(bits=4, levels="uniform", scale_format="log8"), 0.77),
}


def kept_positions(rows: int, tokens: int, kept: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """Each row's ``kept`` of ``tokens`` positions, drawn at random and in order: int16 where they fit, else int32."""
    chosen = torch.rand(rows, tokens, generator=gen, device=device).argsort(dim=-1)[:, :kept].sort(dim=-1).values
    return chosen.to(torch.int16 if tokens <= 32767 else torch.int32)


def packed_view(batch: int, tokens: int, device: str = "cuda", storage: str = "k4v2",
                shape: str = "llama3-8b") -> LowbitView:
    """Random keys and values packed the way ``storage`` packs them (:data:`STORAGES`), [B * KV heads, T', head_dim]
    (T' the tokens kept, a multiple of 64; the heads and head_dim of :data:`SHAPES` ``shape``), in chunks."""
    _, heads, dim, theta = SHAPES[shape]
    make_keys, make_values, share = STORAGES[storage]
    kq, vq = make_keys(), make_values()
    alloc = isinstance(kq, ChannelAllocQuantizer)
    group = kq.tokens_per_group()  # the keys' token group (64, or 128): the tokens kept a multiple of it
    context, tokens = tokens, tokens if share == 1.0 else int(tokens * share) // group * group
    rows = batch * heads
    fields: dict[str, list] = {}
    gen = torch.Generator(device=device).manual_seed(0)
    widths = torch.exp(torch.randn(dim, generator=gen, device=device))
    for first in range(0, rows, 8):
        count = min(8, rows - first)
        keys = torch.randn(count, tokens, dim, generator=gen, device=device) * widths
        values = torch.randn(count, tokens, dim, generator=gen, device=device)
        for name, tensor in kq.quantize(keys).items():
            fields.setdefault("k_" + name, []).append(tensor)
        for name, tensor in vq.quantize(values).items():
            fields.setdefault("v_" + name, []).append(tensor)
        del keys, values
    f = {name: torch.cat(parts) for name, parts in fields.items()}
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    exact = torch.randn(batch, heads, WINDOW, dim, device=device, dtype=torch.bfloat16)
    levels = vq.level_table()
    log8 = vq.scale_format == "log8"
    return LowbitView(
        tokens=tokens, first=0, k_codes=f["k_codes"], k_zero=f["k_zero"], k_scale=f["k_scale"],
        k_out_index=f.get("k_outlier_index"), k_out_value=f.get("k_outlier_value"), k_bits=0 if alloc else kq.bits, k_group=group,
        v_codes=f["v_codes"].reshape(rows, tokens, -1), v_tiled=bool(vq.token_tiles),
        v_scale=f["v_scale_log"] if log8 else f["v_scale"], v_bits=vq.bits, v_group=64,
        v_levels=torch.tensor(levels, device=device, dtype=torch.float32),
        v_levels16=torch.tensor(levels, device=device, dtype=torch.float32).to(torch.bfloat16),  # as the plugin's view
        rotation=rotation_matrix("hadamard", 0, dim, device).float().contiguous(), rotation_hadamard=True, inv_freq=inv_freq,
        rope_scale=1.0, exact_k=exact, exact_v=exact.clone(), level_kind=level_kind(levels),
        k_widths=f["k_bits"] if alloc else None, v_scale_max=f["v_scale_max"] if log8 else None,
        v_scale_tokens=vq.scale_tokens if log8 else 1,
        positions=None if share == 1.0 else kept_positions(rows, context, tokens, gen, device),
        exact_first=None if share == 1.0 else context,
    )


def view_bytes(view: LowbitView) -> int:
    tensors = [view.k_codes, view.k_zero, view.k_scale, view.k_out_index, view.k_out_value, view.k_widths, view.v_codes,
               view.v_scale, view.v_scale_max, view.exact_k, view.exact_v, view.positions]
    return sum(t.nbytes for t in tensors if t is not None)


def kernel_stats(kernel) -> str:
    """Registers and spills of each compiled build of the Triton ``kernel`` (as far as this Triton reports them)."""
    found = []
    try:
        for per_device in getattr(kernel, "device_caches", {}).values():
            for compiled in per_device[0].values():
                found.append(f"{getattr(compiled, 'n_regs', '?')} registers, {getattr(compiled, 'n_spills', '?')} spills")
    except Exception as exc:  # noqa: BLE001 - Triton's cache layout differs between versions; the stats are a courtesy
        return f"(not reported: {type(exc).__name__})"
    return "; ".join(found) or "(not reported)"


def parse_configs(text: str, programs: int) -> list[tuple[str, int, int, int, str]]:
    """``variant:block:warps[:programs[:tricks]]`` items, comma-separated (``wide:32:4,general:16:4:528,
    wide:32:4:528:magic+vb16``); ``programs`` (the kernel programs aimed for, splitting the tokens) defaults to
    ``--programs``, ``tricks`` ("+"-separated names of ``TRICKS``) to none."""
    configs = []
    for item in text.split(","):
        parts = item.split(":")
        tricks = parts[4] if len(parts) == 5 else ""
        if (len(parts) not in (3, 4, 5) or parts[0] not in VARIANTS or not all(part.isdigit() for part in parts[1:4])
                or not all(t in TRICKS for t in tricks.split("+") if t)):
            raise SystemExit(f"--configs: {item!r} is not variant:block:warps[:programs[:tricks]] with variant one of "
                             f"{', '.join(VARIANTS)} and tricks of {', '.join(TRICKS)}")
        configs.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3]) if len(parts) >= 4 else programs, tricks))
    return configs


def config_name(variant: str, block: int, warps: int, programs: int | None, tricks: str) -> str:
    """The configuration as ``--configs`` spells it."""
    return f"{variant}:{block}:{warps}:{programs or 'auto'}" + (f":{tricks}" if tricks else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="32768,65536,131072")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--configs", default="wide:32:4",
                        help="kernels timed, each variant:block:warps[:programs] (variant: wide, general; block: "
                             "tokens per loop step, divides 64; warps per program; programs aimed for, default --programs, 0: the launch's choice)")
    parser.add_argument("--programs", type=int, default=0, help="kernel programs to aim for (splits of the tokens); 0: the "
                        "launch's choice, as model.generate's (until 2026-12-04 the default was 528)")
    parser.add_argument("--storage", default="k4v2", choices=list(STORAGES), help="what is packed: prerope-k4v2's storage, "
                        "channel-alloc keys at 3.5 bits with 3-bit log8 values (qa35v3), or a layer of the shipped 5x / 8x "
                        "KVzip pipelines (kz5, kz8: their tokens kept, positions read with them)")
    parser.add_argument("--post-rope", action="store_true", help="keys stored after RoPE (no rotation in the kernel)")
    parser.add_argument("--as-generate", action="store_true", help="launched with each row's first visible position "
                        "(here 0) and a list of 4 hidden slots a row (here none listed), so the kernel checks both (how "
                        "model.generate launched it over a sinks + KVzip pipeline before hidden_below)")
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES), help="the attention shape: Llama-3-8B's, "
                        "or d256 (16 query heads on 8 KV heads at head_dim 256, Gemma-2-9B's and Gemma-3-12B's)")
    parser.add_argument("--cold-l2", action="store_true", help="each call reads its own copy of the storage (and SDPA "
                        "of the full cache), the copies adding up to 4x the L2 cache, as a decode step's layers read "
                        "theirs; default: every call the same bytes, which the L2 holds where they fit (under ~33 MB on "
                        "an H100: B = 1 at 32K)")
    parser.add_argument("--out", default="results/lowbit_kernel")
    args = parser.parse_args()
    q_heads, kv_heads, dim, _ = SHAPES[args.shape]
    configs = [(v, b, w, p or None, t) for v, b, w, p, t in parse_configs(args.configs, args.programs)]  # 0: the launch's
    if not torch.cuda.is_available():
        raise SystemExit("lowbit_kernel.py times CUDA kernels; run it on a GPU machine")
    bandwidth = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write)")
    scale = dim ** -0.5
    small = packed_view(1, 4096, storage=args.storage, shape=args.shape)
    if args.post_rope:
        small = attrs.evolve(small, inv_freq=None)
    q_small = torch.randn(1, q_heads, dim, device="cuda")
    reference = torch_lowbit_decode(small, q_small, None, scale)
    twins = {}
    for variant, block, warps, programs, tricks in configs:
        name = config_name(variant, block, warps, programs, tricks)
        out = lowbit_decode(small, q_small, None, scale, block, warps, variant, programs, tricks)
        twins[name] = float((out - reference).abs().max())
        launch = plan_launch(small, q_small, None, scale, block, warps, variant, programs, tricks=tricks)
        print(f"{name}: largest difference from the torch twin (T = 4096, B = 1) {twins[name]:.2e}; compiled: {kernel_stats(launch.kernel)}")
    rows = []
    print("\n| T | B | kernel | SDPA us (GPU) | lowbit us (GPU) | of which combine | lowbit us (wall) | speed-up (GPU) | SDPA / lowbit us (graph) | speed-up (graph) | bytes read | GB/s | % of copy bw | bytes ratio |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            full_bytes = 2 * batch * kv_heads * (tokens + WINDOW) * dim * 2
            if full_bytes > 60e9:
                continue
            view = packed_view(batch, tokens, storage=args.storage, shape=args.shape)
            if args.post_rope:
                view = attrs.evolve(view, inv_freq=None)
            start = None
            if args.as_generate:
                start = torch.zeros(batch, dtype=torch.int32, device="cuda")
                view = attrs.evolve(view, hidden_slots=torch.full((batch * kv_heads, 4), -1, dtype=torch.int32, device="cuda"))
            q = torch.randn(batch, q_heads, dim, device="cuda", dtype=torch.bfloat16)
            keys = torch.randn(batch, kv_heads, tokens + WINDOW, dim, device="cuda", dtype=torch.bfloat16)
            values = torch.randn_like(keys)
            caches = read_in_turn((keys, values), full_bytes, args.cold_l2)
            sdpa_call = lambda: F.scaled_dot_product_attention(q[:, :, None], *caches(), enable_gqa=True)  # noqa: E731
            sdpa = device_us(sdpa_call, args.reps)
            sdpa_graph = graph_us(sdpa_call, args.reps)
            del caches
            read = view_bytes(view)
            views = read_in_turn(view, read, args.cold_l2)
            for variant, block, warps, programs, tricks in configs:
                call = lambda: lowbit_decode(views(), q, start, scale, block, warps, variant, programs, tricks)  # noqa: E731
                parts = device_us_parts(call, args.reps)
                kernel = sum(parts.values())
                combine = sum(us for name, us in parts.items() if "combine" in name)
                wall = timed(call, args.reps)
                graph = graph_us(call, args.reps)
                row = {"tokens": tokens, "batch": batch, "kernel": config_name(variant, block, warps, programs, tricks), "sdpa_us": sdpa, "kernel_us": kernel,
                       "packed_us": kernel - combine, "combine_us": combine,
                       "sdpa_graph_us": sdpa_graph, "graph_us": graph, "graph_speedup": sdpa_graph / graph,
                       "wall_us": wall, "speedup": sdpa / kernel, "bytes_read": read, "gbps": read / kernel / 1e3,
                       "of_copy": read / (kernel * 1e-6) / bandwidth, "bytes_ratio": full_bytes / read}
                rows.append(row)
                print(f"| {tokens} | {batch} | {row['kernel']} | {sdpa:.1f} | {kernel:.1f} | {combine:.1f} | {wall:.1f} | {row['speedup']:.2f}x | "
                      f"{sdpa_graph:.1f} / {graph:.1f} | {row['graph_speedup']:.2f}x | "
                      f"{read / 1e6:.1f} MB | {row['gbps']:.0f} | {100 * row['of_copy']:.0f}% | {row['bytes_ratio']:.2f}x |", flush=True)
            del view, views, keys, values
            torch.cuda.empty_cache()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.date.today().isoformat()
    (out / "lowbit_kernel.json").write_text(json.dumps({"date": stamp, "device": torch.cuda.get_device_name(), "configs": args.configs,
                                                        "storage": args.storage + ("-post" if args.post_rope else ""), "shape": args.shape,
                                                        "cold_l2": args.cold_l2,
                                                        "copy_bandwidth": bandwidth, "twin_difference": twins, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
