"""Decode attention alone: the fused DepthWeave-KV kernel against SDPA over a full bf16 cache.

    python benchmarks/decode_kernel.py [--tokens 16384,65536,131072] [--batches 1,8] [--variants tiles,gather]
        [--combines two-pass,one-pass,one-pass/8] [--split 0,1024,2048] [--cold-l2] [--out DIR]

Shape: Llama-3-8B attention (32 query heads, 8 KV heads, head_dim 128), one new query token per sequence.
For each context length the storage is written by the real engine with ``depthweave-kv``'s settings
(one 4-layer window: the kernel reads one layer; budget, versions and residual lists as in a full model)
from synthetic cross-layer-structured K/V (:mod:`kvweave.engine.synthetic`); the full cache is random bf16
K/V of the same size. A smaller batch uses the first rows of the largest batch's storage.

Reported per (T, B): SDPA time and kernel time (GPU time: the kernels' device time from the torch profiler,
mean of ``--reps`` calls, and of it the exact-window pass's and the combine's), speed-up, both again as 20 calls
replayed from a CUDA graph (:func:`graph_us`; the passes may overlap there, as they do in a decode step) and that
speed-up, the host time per kernel call (three launches, outside any graph), the bytes the
kernel reads (``nbytes`` of every stored tensor of the layer it attends over, residual tile index, bases
and exact window included), the bandwidth that implies, its share of the measured copy bandwidth, the
layer's compression ratio against 16 bits, and the largest difference from the torch twin. A row per packed-token
pass (``--variants``), split (``--split``: tokens a program, 0 the cache's own segments) and combine pass (``--combines``, :data:`kvweave.kernels.depthweave_decode.COMBINES`; ``one-pass/N``:
the one-pass combine with N programs a query head instead of ``COMBINE_SLICES``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import time
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import load_pipeline
from kvweave.engine.residuals import ResidualList
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.decode_view import TILE, DecodeView, ResidualLevel, choose_split
from kvweave.kernels import tiles_tail
from kvweave.kernels import depthweave_decode
from kvweave.kernels.depthweave_decode import COMBINE, COMBINES, fused_decode

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
#: the one-pass combine's programs a query head that ``--combines one-pass/N`` takes (at least 8 columns a program)
MAX_SLICES_LIST = (1, 2, 4, 8, 16)


def llama3_window_config(layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128, hidden_size=Q_HEADS * HEAD_DIM, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=Q_HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
    )


def timed(fn, reps: int) -> float:
    """Median microseconds of ``fn()`` over ``reps`` runs (CUDA events, after 3 warm-up runs)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000)
    times.sort()
    return times[len(times) // 2]


def device_us_parts(fn, reps: int) -> dict[str, float]:
    """Microseconds of GPU time per call of ``fn`` for each kernel it launches (by name): the torch profiler's device
    time over ``reps`` calls (after 3 warm-up calls), divided by ``reps``. Host launch time is not in it."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    parts: dict[str, float] = {}
    for event in prof.key_averages():
        spent = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)
        if spent:
            parts[event.key] = parts.get(event.key, 0.0) + spent / reps
    return parts


def device_us(fn, reps: int) -> float:
    """Microseconds of GPU kernel time per call of ``fn``: the sum of its kernels' device time
    (:func:`device_us_parts`). Host launch time is not in it (:func:`host_us` reports that)."""
    return sum(device_us_parts(fn, reps).values())


def graph_us(fn, reps: int, calls: int = 20) -> float:
    """Microseconds of GPU time per call of ``fn`` as a CUDA graph replays it: ``calls`` calls captured in one graph
    (after 3 warm-up calls on a side stream), the median over ``reps`` replays (CUDA events) divided by ``calls``. What
    a decode step replayed from a graph sees: the kernels, the gaps between them and any overlap (a kernel launched as a
    programmatic dependent starts before the one it follows ends, which the profiler's per-kernel times count twice)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) * 1000 / calls)
    times.sort()
    return times[len(times) // 2]


#: with a cold L2 cache (``--cold-l2``), the bytes the copies that timed calls read in turn add up to at least, in
#: multiples of the GPU's L2 cache: none is still in the L2 when it is read again, as in a decode step, where the other
#: layers' bytes pass through the L2 between two reads of one layer's (20 calls over one 14 MB storage read it from an
#: H100's 50 MB L2 at 125% of the copy bandwidth: docs/kernels.md "The floor under the bars")
L2_MULTIPLE = 4


def cold_copies(nbytes: int, cold: bool = True) -> int:
    """Copies of ``nbytes`` whose bytes add up to at least :data:`L2_MULTIPLE` times this GPU's L2 cache (``cold``), else
    1 (every call reads the same bytes)."""
    if not cold:
        return 1
    return max(1, -(-L2_MULTIPLE * torch.cuda.get_device_properties(0).L2_cache_size // max(1, nbytes)))


def in_turn(items: list):
    """A function that returns ``items`` one after another, round and round (a CUDA graph captures each call's pick)."""
    state = {"next": 0}

    def pick():
        item = items[state["next"] % len(items)]
        state["next"] += 1
        return item

    return pick


def tensor_copies(item, copies: int) -> list:
    """``item`` (an attrs instance, a tensor or a tuple of tensors) and ``copies - 1`` others holding the same values in
    tensors of their own."""
    def cloned(value):
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (tuple, list)):
            return type(value)(cloned(v) for v in value)
        if attrs.has(type(value)):
            return attrs.evolve(value, **{f.name: cloned(getattr(value, f.name)) for f in attrs.fields(type(value))
                                          if f.init and getattr(value, f.name) is not None})
        return value

    return [item] + [cloned(item) for _ in range(copies - 1)]


def read_in_turn(item, nbytes: int, cold: bool):
    """A function returning ``item`` (of ``nbytes`` read a call) or, ``cold``, its :func:`cold_copies` in turn."""
    return in_turn(tensor_copies(item, cold_copies(nbytes, cold)))


def host_us(fn, reps: int = 20) -> float:
    """Microseconds the host spends per call (launches queued, no synchronization)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = (time.perf_counter() - start) / reps * 1e6
    torch.cuda.synchronize()
    return elapsed


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    us = timed(lambda: dst.copy_(src), 10)
    del src, dst
    return 2 * nbytes / (us * 1e-6)


def view_bytes(view: DecodeView) -> int:
    """Bytes the kernel reads for this view: every tensor it is given, by its own size."""
    tensors = [view.k_codes, view.k_scales, view.v_codes, view.v_scales, view.exact_k, view.exact_v]
    tensors += [view.k_bases, view.v_bases]  # read once per program; counted once
    for level in view.k_levels + view.v_levels:
        tensors += [level.packed, level.scales, level.tile_start, level.tile_mask]
    total = sum(t.numel() * t.element_size() for t in tensors)
    return total


def first_rows(view: DecodeView, rows: int) -> DecodeView:
    """The view of the batch's first ``rows`` rows: their coefficients, windows, only their residual entries
    (re-indexed), and segments split for their programs (as a cache of that batch would split them)."""
    heads = view.exact_k.shape[1]

    def keep(level: ResidualLevel) -> ResidualLevel:
        row, token = (t.long() for t in level.located())
        chosen = (row < rows * heads).nonzero().squeeze(1)
        chosen = chosen[torch.argsort(row[chosen] * view.packed_tokens + token[chosen])]  # one block: by row, then token
        lists = ResidualList(level.rank, tiles=True)
        lists.append({"row": row[chosen], "token": token[chosen], "q_packed": level.packed[chosen], "q_scales": level.scales[chosen]},
                     0, view.packed_tokens, rows * heads)
        start, mask = lists.tile_index(rows * heads, view.packed_tokens // TILE, level.packed.device)
        f = lists.fields
        return ResidualLevel(level.rank, level.group, lists.entries, f["q_packed"], f["q_scales"], start, mask, lists.located)

    segments = tiles_tail.resplit_rows(view.segments, choose_split(view.packed_tokens, rows * heads), rows * heads)
    return DecodeView(
        view.packed_tokens, view.k_codes[:rows], view.k_scales[:rows], view.v_codes[:rows], view.v_scales[:rows],
        view.k_bases[:rows], view.v_bases[:rows], segments,
        tuple(keep(lv) for lv in view.k_levels), tuple(keep(lv) for lv in view.v_levels),
        None if view.k_residual_basis is None else view.k_residual_basis[:rows],
        None if view.v_residual_basis is None else view.v_residual_basis[:rows],
        view.k_gates, view.v_gates, view.exact_k[:rows], view.exact_v[:rows],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="16384,65536,131072")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--pipeline", default="depthweave-kv")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--block-tokens", type=int, default=64, help="tokens per loop iteration of the kernel")
    parser.add_argument("--num-warps", type=int, default=None, help="warps per kernel program (default: fused_decode's, 1 for either pass)")
    parser.add_argument("--variants", default="tiles", help="packed-token passes to time, comma-separated: tiles, gather")
    parser.add_argument("--split", default="0", help="tokens per program, comma-separated, each a row (0: the cache's own "
                        "segments, as choose_split cuts them for the batch; others a multiple of 32)")
    parser.add_argument("--combines", default=COMBINE,
                        help=f"combine passes to time, comma-separated: {', '.join(COMBINES)}, or one-pass/N for N programs a "
                             f"query head (default: fused_decode's, {COMBINE})")
    parser.add_argument("--cold-l2", action="store_true", help="each call reads its own copy of the storage (and SDPA "
                        "of the full cache), the copies adding up to 4x the L2 cache, as a decode step's layers read theirs")
    parser.add_argument("--out", default="results/decode_kernel")
    args = parser.parse_args()
    splits = parse_splits(args.split)
    if splits is None:
        parser.error(f"--split: expected comma-separated token counts, each 0 or a positive multiple of {TILE}; got {args.split!r}")
    unknown = [entry for entry in args.combines.split(",") if combine_slices(entry) is None]
    if unknown:
        parser.error(f"--combines: unknown {', '.join(unknown)}; expected a list of {', '.join(COMBINES)} or one-pass/N "
                     f"(N in {', '.join(map(str, MAX_SLICES_LIST))})")
    if not torch.cuda.is_available():
        raise SystemExit("decode_kernel.py times CUDA kernels; run it on a GPU machine")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    copy_bw = copy_bandwidth()
    rows = []
    pipeline = load_pipeline(args.pipeline)
    for tokens in [int(t) for t in args.tokens.split(",")]:
        cache = KVWeaveCache(pipeline, llama3_window_config())
        fill_cache(cache, max(batches), tokens, chunk=8192, device="cuda", seed=tokens)
        engine = cache.engine
        layer = 1
        full_view = engine.kernel.decode_view(engine.view(layer), torch.device("cuda"))
        ratio = cache.compression_ratio()
        for batch in batches:
            own = full_view if batch == max(batches) else first_rows(full_view, batch)
            read = view_bytes(own)
            generator = torch.Generator(device="cuda").manual_seed(batch)
            q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", generator=generator).to(torch.bfloat16)
            scale = HEAD_DIM**-0.5
            total = engine.seq_length(layer)
            k_full = torch.randn(batch, KV_HEADS, total, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
            v_full = torch.randn_like(k_full)
            q4 = q.unsqueeze(2)
            full_bytes = 2 * k_full.nbytes
            caches = read_in_turn((k_full, v_full), full_bytes, args.cold_l2)
            sdpa = lambda: F.scaled_dot_product_attention(q4, *caches(), scale=scale, enable_gqa=True)  # noqa: E731
            sdpa_us = device_us(sdpa, args.reps)
            sdpa_graph_us = graph_us(sdpa, args.reps)
            del k_full, v_full, caches
            twin = torch_decode(own, q, None, scale).float()
            for split in splits:
                # cut once here: fused_decode's split= cuts on the host each call, which a graph cannot hold
                view = own if not split else attrs.evolve(own, segments=tiles_tail.resplit_rows(own.segments, split, batch * KV_HEADS))
                views = read_in_turn(view, read, args.cold_l2)
                for variant in args.variants.split(","):
                    for combine in args.combines.split(","):
                        row = _timed_row(views, q, scale, (variant, combine), args, twin, read, (sdpa_us, sdpa_graph_us),
                                         full_bytes, copy_bw, total, batch, ratio)
                        row.update(split=split, programs=view.segments.shape[0] * batch * KV_HEADS)
                        rows.append(row)
                        print(rows[-1], flush=True)
                del views
        del cache, engine, full_view
        torch.cuda.empty_cache()
    _write(rows, args, copy_bw, out)


def parse_splits(text: str) -> list[int] | None:
    """``--split``'s token counts (0: the cache's own segments), or None where one is not 0 or a positive multiple of
    :data:`TILE`."""
    try:
        splits = [int(part) for part in text.split(",")]
    except ValueError:
        return None
    return splits if all(s == 0 or (s > 0 and s % TILE == 0) for s in splits) else None


def combine_slices(entry: str) -> int | None:
    """The programs a query head of a ``--combines`` entry (``one-pass/N``: N; otherwise ``COMBINE_SLICES``); None for an
    entry that names no combine."""
    name, _, slices = entry.partition("/")
    if name not in COMBINES or (slices and name != "one-pass"):
        return None
    if not slices:
        return depthweave_decode.COMBINE_SLICES
    if not slices.isdigit() or int(slices) not in MAX_SLICES_LIST:
        return None
    return int(slices)


def _timed_row(views, q, scale, passes, args, twin, read, sdpa, full_bytes, copy_bw, total, batch, ratio) -> dict:
    """One (T, B, variant, combine) row over the storage ``views()`` returns (one view, or copies in turn: ``--cold-l2``;
    ``passes``: the packed-token pass and the combine): the kernel's device time
    (and of it the exact-window pass's and the combine's), its time replayed from a CUDA graph and its host time, against
    SDPA's (``sdpa``: device and graph time), its bandwidth and its error."""
    sdpa_us, sdpa_graph_us = sdpa
    variant, combine = passes
    combine_name, slices = combine.partition("/")[0], combine_slices(combine)
    fused = lambda: fused_decode(views(), q, None, scale, block_tokens=args.block_tokens,  # noqa: E731
                                 num_warps=args.num_warps, variant=variant, combine=combine_name)
    default_slices, depthweave_decode.COMBINE_SLICES = depthweave_decode.COMBINE_SLICES, slices
    try:
        parts = device_us_parts(fused, args.reps)
        kernel_us = sum(parts.values())
        kernel_graph_us = graph_us(fused, args.reps)
        kernel_host_us = host_us(fused)
        error = (fused().float() - twin).abs().max().item()
    finally:
        depthweave_decode.COMBINE_SLICES = default_slices
    bandwidth = read / (kernel_us * 1e-6)
    return {
        "tokens": total, "batch": batch, "variant": variant, "combine": combine, "sdpa_us": round(sdpa_us, 1),
        "kernel_us": round(kernel_us, 1), "speedup": round(sdpa_us / kernel_us, 2),
        "exact_us": round(sum(us for name, us in parts.items() if "_exact_split" in name), 1),
        "combine_us": round(sum(us for name, us in parts.items() if "_combine" in name), 1),
        "sdpa_graph_us": round(sdpa_graph_us, 1), "kernel_graph_us": round(kernel_graph_us, 1),
        "graph_speedup": round(sdpa_graph_us / kernel_graph_us, 2),
        "kernel_host_us": round(kernel_host_us, 1), "kernel_bytes": read, "full_bytes": full_bytes,
        "bytes_ratio": round(full_bytes / read, 2), "cache_ratio": round(ratio, 2),
        "kernel_TBps": round(bandwidth / 1e12, 2), "copy_share": round(bandwidth / copy_bw, 3),
        "sdpa_TBps": round(full_bytes / (sdpa_us * 1e-6) / 1e12, 2), "max_abs_diff_vs_torch": error,
    }


def _write(rows: list[dict], args, copy_bw: float, out: Path) -> None:
    """The rows as a markdown table and JSON under ``out``."""
    header = ["T", "B", "pass", "tokens / program (programs)", "SDPA (us)", "fused (us)", "of it exact / combine", "speed-up", "SDPA / fused (us, graph)",
              "speed-up (graph)", "fused host (us)", "bytes read (MB)", "full bf16 (MB)", "fused TB/s", "% of copy BW", "SDPA TB/s", "max |diff| vs torch"]
    lines = [
        f"# decode attention, Llama-3-8B shape (32 q heads, 8 KV heads, d=128), pipeline {args.pipeline}",
        f"# {datetime.date.today()} {torch.cuda.get_device_name()} torch {torch.__version__}; copy bandwidth {copy_bw / 1e12:.2f} TB/s",
        "| " + " | ".join(header) + " |", "|" + "---|" * len(header),
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['batch']} | {r['variant']}, {r['combine']} | {r['split'] or 'own'} ({r['programs']}) | {r['sdpa_us']} | {r['kernel_us']} | {r['exact_us']} / {r['combine_us']} | "
            f"{r['speedup']}x | {r['sdpa_graph_us']} / {r['kernel_graph_us']} | {r['graph_speedup']}x | {r['kernel_host_us']} | {r['kernel_bytes'] / 1e6:.1f} | "
            f"{r['full_bytes'] / 1e6:.1f} | {r['kernel_TBps']} | {100 * r['copy_share']:.0f} % | {r['sdpa_TBps']} | {r['max_abs_diff_vs_torch']:.2e} |"
        )
    (out / "decode_kernel.md").write_text("\n".join(lines) + "\n")
    (out / "decode_kernel.json").write_text(json.dumps({"copy_bandwidth": copy_bw, "rows": rows}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
