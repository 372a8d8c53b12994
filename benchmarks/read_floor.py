"""The floor under a decode kernel's time: how long this GPU takes only to read a compressed cache's bytes.

    python benchmarks/read_floor.py [--tokens 32768,65536,131072] [--batches 1,8,32]
        [--storages k4v2e48t,k4v4e77t] [--ratios 8.25] [--reps 10] [--warm-l2] [--out DIR]
    python benchmarks/read_floor.py --plot DIR/read_floor.json      # the plot of an earlier run, no GPU

The kernel bars of docs/kernels.md ask a decode call to be at least 0.7 x (bytes ratio) faster than SDPA over the full
bfloat16 cache. A call cannot be faster than reading its bytes once, so for each cell (T, B) and storage this script
times, as calls replayed from a CUDA graph (``decode_kernel.graph_us``, as the kernel benchmarks do):

- SDPA over the full bf16 cache (Llama-3-8B attention: 32 query heads, 8 KV heads, head_dim 128, 16 exact tokens);
- ``read``: one Triton launch that reads exactly the storage's bytes (``nbytes`` of every packed tensor and of the
  exact window, ``lowbit_kernel.view_bytes``) as 32-bit words with vector loads and sums them, the best of several
  program counts: no kernel that reads those bytes once can take less;
- ``read + fold``: the same followed by a second, dependent launch with one program per (row, KV head) that folds the
  first launch's partial sums: the floor of a split-K design (a pass, then a combine), which the kernels here are;
- the ``dense`` kernel itself, as ``model.generate`` launches it (the launch's own splits and rules);
- the launch alone: a graph of one or two dependent launches of a program that reads nothing.

``--storages`` are ``lowbit_kernel.py``'s (their keys after RoPE, as the bars' table times them); ``--ratios`` adds rows
for a cache that many times smaller than the bf16 cache with no kernel of its own (8.25: depthweave-kv's stored bytes,
whose kernel ``decode_kernel.py`` times). Printed: each row's speed-up over SDPA for the floors and the kernel, the bar,
the share of the copy bandwidth the floors reach, and the bar's room: the time the bar allows a call over ``read +
fold``'s (under 1: not even a pass and a combine that only read the bytes meet the bar); JSON in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

import torch
import torch.nn.functional as F

try:  # the read kernels need Triton; --help and the refusals do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is missing
    triton = None

#: 32-bit words a program's step loads (8 a thread at 4 warps: two 16-byte loads each)
READ_BLOCK = 1024
#: the programs a read launch is timed with, as multiples of the multiprocessors (the best is its floor)
PROGRAMS_PER_SM = (1, 2, 4, 8, 16)
#: how far the bars ask a kernel to be faster than SDPA, as a share of the bytes ratio
BAR_SHARE = 0.7

if triton is not None:

    @triton.jit
    def _read_words(src, partial, words, chunk, BLOCK: tl.constexpr):
        """Program ``p`` sums (wrapping int32) the words ``[p * chunk, (p + 1) * chunk)`` of ``src`` that exist and
        writes the sum to ``partial[p]`` (``chunk`` a multiple of ``BLOCK``)."""
        pid = tl.program_id(0)
        first = pid * chunk
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for step in range(0, chunk, BLOCK):
            offs = first + step + tl.arange(0, BLOCK)
            acc += tl.load(src + offs, mask=offs < words, other=0)
        tl.store(partial + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _fold(partial, out, programs, per, BLOCK: tl.constexpr):
        """Program ``r`` sums the partials ``[r * per, (r + 1) * per)`` that exist into ``out[r]``."""
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.int32)
        for step in range(0, per, BLOCK):
            local = step + tl.arange(0, BLOCK)
            idx = row * per + local
            acc += tl.load(partial + idx, mask=(local < per) & (idx < programs), other=0)
        tl.store(out + row, tl.sum(acc, axis=0))


def read_chunk(words: int, programs: int) -> int:
    """The words each of ``programs`` programs reads of ``words``: an equal share rounded up to whole steps."""
    return -(-words // (programs * READ_BLOCK)) * READ_BLOCK


def read_words(src: torch.Tensor, programs: int, partial: torch.Tensor | None = None) -> torch.Tensor:
    """The int32 words of ``src`` (flat, contiguous) summed in ``programs`` chunks by one launch: [programs] int32
    (into ``partial`` where given, to be captured in a graph)."""
    if triton is None:
        raise RuntimeError("read_floor.py needs Triton")
    if src.dtype != torch.int32 or src.dim() != 1 or not src.is_contiguous():
        raise ValueError(f"read_words reads a flat contiguous int32 tensor, got {src.dtype} of shape {tuple(src.shape)}")
    if programs < 1:
        raise ValueError(f"read_words needs at least one program, got {programs}")
    words = src.numel()
    chunk = read_chunk(words, programs)
    partial = torch.empty(programs, dtype=torch.int32, device=src.device) if partial is None else partial
    _read_words[(programs,)](src, partial, words, chunk, BLOCK=READ_BLOCK, num_warps=4)
    return partial


def fold(partial: torch.Tensor, rows: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``partial`` summed in ``rows`` consecutive shares, one program each (a dependent second launch): [rows] int32."""
    if rows < 1:
        raise ValueError(f"fold needs at least one row, got {rows}")
    per = -(-partial.numel() // rows)
    out = torch.empty(rows, dtype=torch.int32, device=partial.device) if out is None else out
    _fold[(rows,)](partial, out, partial.numel(), per, BLOCK=64, num_warps=1)
    return out


def floors(nbytes: int, rows: int, reps: int, sms: int, copies: int) -> dict[str, float]:
    """Graph time (us a call) of reading ``nbytes`` once, alone (``read``) and followed by a fold over ``rows`` rows
    (``read_fold``), each the best over :data:`PROGRAMS_PER_SM`; and the programs that gave each. The calls read
    ``copies`` buffers in turn."""
    from decode_kernel import graph_us, in_turn

    sources = [torch.randint(-2**31, 2**31 - 1, (-(-nbytes // 4),), dtype=torch.int32, device="cuda")
               for _ in range(copies)]
    out = torch.empty(rows, dtype=torch.int32, device="cuda")
    best: dict[str, float] = {}
    for per_sm in PROGRAMS_PER_SM:
        programs = per_sm * sms
        partial = torch.empty(programs, dtype=torch.int32, device="cuda")
        for name in ("read", "read_fold"):
            source = in_turn(sources)
            if name == "read":
                call = lambda: read_words(source(), programs, partial)  # noqa: E731
            else:
                call = lambda: fold(read_words(source(), programs, partial), rows, out)  # noqa: E731
            us = graph_us(call, reps)
            if us < best.get(name + "_us", float("inf")):
                best[name + "_us"], best[name + "_programs"] = us, programs
    del sources
    return best


def launch_floor(reps: int) -> dict[str, float]:
    """Graph time (us a call) of one launch of a program that reads nothing, and of two dependent ones."""
    from decode_kernel import graph_us

    empty = torch.empty(0, dtype=torch.int32, device="cuda")
    partial = torch.empty(1, dtype=torch.int32, device="cuda")
    out = torch.empty(1, dtype=torch.int32, device="cuda")
    return {"one_launch_us": graph_us(lambda: read_words(empty, 1, partial), reps),
            "two_launches_us": graph_us(lambda: fold(read_words(empty, 1, partial), 1, out), reps)}


def plot(record: dict, path: Path) -> None:
    """``record`` (a ``read_floor.json``) drawn to ``path``: for each storage a panel a context, the speed-up over SDPA
    against the batch of the read floor (past the L2 cache: a filled marker; in it: hollow), of ``read + fold`` and of
    the kernel, with the bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = record["rows"]
    storages = list(dict.fromkeys(r["storage"] for r in rows))
    contexts = sorted({r["tokens"] for r in rows})
    fig, axes = plt.subplots(len(storages), len(contexts), figsize=(4 * len(contexts), 3 * len(storages)), squeeze=False,
                             sharex=True)
    l2 = record.get("l2_bytes", 50 * 2**20)
    for i, storage in enumerate(storages):
        for j, tokens in enumerate(contexts):
            ax = axes[i][j]
            cell = sorted((r for r in rows if r["storage"] == storage and r["tokens"] == tokens), key=lambda r: r["batch"])
            if not cell:
                ax.set_visible(False)
                continue
            batches = [r["batch"] for r in cell]
            for key, label, style, color in (("read_us", "read", "o-", "tab:blue"),
                                             ("read_fold_us", "read + fold", "s-", "tab:green"),
                                             ("kernel_us", "kernel", "^-", "tab:purple")):
                points = [(r["batch"], r["sdpa_us"] / r[key], r["bytes_read"] * r.get("copies", 1) < l2)
                          for r in cell if r.get(key)]
                if not points:
                    continue
                ax.plot([b for b, _, _ in points], [v for _, v, _ in points], style, color=color, label=label)
                warm = [(b, v) for b, v, in_l2 in points if in_l2]
                if warm:  # the L2 held these bytes between calls: hollow markers
                    ax.plot([b for b, _ in warm], [v for _, v in warm], "o", mfc="white", mec=color, ms=9)
            ax.axhline(cell[0]["bar"], color="grey", ls="--", label="bar (0.7 x bytes ratio)")
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches, [str(b) for b in batches])
            ax.set_title(f"{storage}, {tokens // 1024}K", fontsize=10)
            ax.set_ylim(bottom=0)
            if j == 0:
                ax.set_ylabel("speed-up over SDPA")
            if i == len(storages) - 1:
                ax.set_xlabel("batch")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"{record['device']}, {record['date']}: the floor under the bars (hollow: bytes held in L2)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    from decode_kernel import L2_MULTIPLE, cold_copies, copy_bandwidth, graph_us, read_in_turn
    from kvweave.kernels.lowbit_decode import lowbit_decode
    from lowbit_kernel import SHAPES, STORAGES, WINDOW, packed_view, view_bytes

    import attrs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="32768,65536,131072")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--storages", default="k4v2e48t,k4v4e77t", help="lowbit_kernel.py storages, keys after RoPE, "
                        "timed with the dense kernel too ('' for none)")
    parser.add_argument("--ratios", default="8.25", help="bytes ratios against the bf16 cache with no kernel timed "
                        "(8.25: depthweave-kv's; '' for none)")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warm-l2", action="store_true", help="every call reads the same bytes (as the kernel "
                        "benchmarks time it), which the L2 cache holds where they fit; default: copies read in turn "
                        f"adding up to {L2_MULTIPLE}x the L2 cache, as a decode step's layers read theirs")
    parser.add_argument("--out", default="results/read_floor")
    parser.add_argument("--plot", metavar="JSON", help="draw an earlier run's read_floor.json to read_floor.png beside "
                        "it (no GPU needed) and stop")
    args = parser.parse_args()
    if args.plot:
        path = Path(args.plot)
        if not path.is_file():
            raise SystemExit(f"--plot: no file {path}")
        plot(json.loads(path.read_text()), path.with_name("read_floor.png"))
        print(f"wrote {path.with_name('read_floor.png')}")
        return
    storages = [s for s in args.storages.split(",") if s]
    unknown = [s for s in storages if s not in STORAGES]
    if unknown:
        raise SystemExit(f"--storages: {unknown} are not lowbit_kernel.py storages ({', '.join(STORAGES)})")
    try:
        ratios = [float(r) for r in args.ratios.split(",") if r]
    except ValueError:
        raise SystemExit(f"--ratios: {args.ratios!r} is not a comma-separated list of numbers") from None
    if any(r <= 1 for r in ratios):
        raise SystemExit(f"--ratios: {ratios} must each be more than 1 (a cache that many times smaller than bf16)")
    if not torch.cuda.is_available():
        raise SystemExit("read_floor.py times CUDA kernels; run it on a GPU machine")
    q_heads, kv_heads, dim, _ = SHAPES["llama3-8b"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    bandwidth = copy_bandwidth()
    launches = launch_floor(args.reps)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    reading = ("every call the same bytes" if args.warm_l2 else
               f"each call its own copy, the copies at least {L2_MULTIPLE}x the {l2 / 2**20:.0f} MiB L2 cache")
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (read + write), {sms} SMs; "
          f"a launch that reads nothing {launches['one_launch_us']:.2f} us, two dependent ones "
          f"{launches['two_launches_us']:.2f} us (graph time); {reading}")
    print("\n| T | B | storage | bytes read | bytes ratio | SDPA us | read us (% copy bw) | read + fold us | kernel us "
          "| speed-up: read / read + fold / kernel | bar | kernel / (read + fold) | bar's room over read + fold |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for batch in (int(b) for b in args.batches.split(",")):
            full_bytes = 2 * batch * kv_heads * (tokens + WINDOW) * dim * 2
            q = torch.randn(batch, q_heads, dim, device="cuda", dtype=torch.bfloat16)
            keys = torch.randn(batch, kv_heads, tokens + WINDOW, dim, device="cuda", dtype=torch.bfloat16)
            cache = read_in_turn((keys, torch.randn_like(keys)), full_bytes, not args.warm_l2)
            sdpa = graph_us(lambda: F.scaled_dot_product_attention(q[:, :, None], *cache(), enable_gqa=True), args.reps)
            del keys, cache
            torch.cuda.empty_cache()
            cases = [(name, None) for name in storages] + [(f"{r:g}x smaller", r) for r in ratios]
            for name, ratio in cases:
                kernel = None
                if ratio is None:
                    view = attrs.evolve(packed_view(batch, tokens, storage=name), inv_freq=None)
                    read = view_bytes(view)
                    views = read_in_turn(view, read, not args.warm_l2)
                    kernel = graph_us(lambda: lowbit_decode(views(), q, None, dim ** -0.5, 64, 4, "dense", None), args.reps)
                    del view, views
                    torch.cuda.empty_cache()
                else:
                    read = int(full_bytes / ratio)
                copies = cold_copies(read, not args.warm_l2)
                floor = floors(read, batch * kv_heads, args.reps, sms, copies)
                row = {"tokens": tokens, "batch": batch, "storage": name, "bytes_read": read, "copies": copies,
                       "bytes_ratio": full_bytes / read, "sdpa_us": sdpa, "kernel_us": kernel, **floor,
                       "read_of_copy": read / (floor["read_us"] * 1e-6) / bandwidth}
                row["bar"] = BAR_SHARE * row["bytes_ratio"]
                row["room"] = sdpa / floor["read_fold_us"] / row["bar"]  # the time the bar allows, over the floor
                rows.append(row)
                versus = "-" if kernel is None else f"{kernel / floor['read_fold_us']:.2f}"
                speedups = [sdpa / floor["read_us"], sdpa / floor["read_fold_us"]] + ([sdpa / kernel] if kernel else [])
                print(f"| {tokens} | {batch} | {name} | {read / 1e6:.1f} MB | {row['bytes_ratio']:.2f}x | {sdpa:.1f} | "
                      f"{floor['read_us']:.1f} ({100 * row['read_of_copy']:.0f}%) | {floor['read_fold_us']:.1f} | "
                      f"{'-' if kernel is None else f'{kernel:.1f}'} | {' / '.join(f'{s:.2f}x' for s in speedups)} | "
                      f"{row['bar']:.2f}x | {versus} | {row['room']:.2f} |",
                      flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(), "sms": sms,
        "copy_bandwidth": bandwidth, "l2_bytes": l2,
        "warm_l2": args.warm_l2, **launches, "rows": rows}
    (out / "read_floor.json").write_text(json.dumps(record, indent=1))
    plot(record, out / "read_floor.png")


if __name__ == "__main__":
    main()
