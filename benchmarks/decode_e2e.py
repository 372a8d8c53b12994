"""End-to-end decoding with ``model.generate`` on a Llama-3-8B-shaped model with random bf16 weights (``--shape d256``:
Gemma-2-9B's sizes and attention shape, head_dim 256).

    python benchmarks/decode_e2e.py [--context 65536] [--batches 1,4,8] [--max-batch] [--ttft 32768] [--registry FILE]
        [--shape llama3-8b|d256] [--out DIR]

For each method (``full``: DynamicCache + sdpa; ``depthweave-kv``: the fused kernel; its reference-kernel
ablation) and batch size: the cache is pre-filled with ``--context`` tokens per sequence (random K/V for
the full cache; synthetic cross-layer K/V through kvweave's own encoder for the compressed ones, see
:mod:`kvweave.engine.synthetic`), then ``model.generate`` decodes ``--steps`` tokens. Reported: the median
and the mean decode step (the mean includes the steps that compress a block), tokens/s = B / step, the
cache's stored bytes and the peak of ``torch.cuda.max_memory_allocated`` during decoding. ``--max-batch``
adds, per method, the largest batch that fits (the full cache: the issue's measured 12, checked here; the
compressed ones: estimated from the measured per-sequence memory, reduced until it runs).
A compressed cache of more than ``--fill-rows`` sequences is filled for that many rows through the encoder
and then grown to B rows by the cache's own batch selection (``select_batch``, as beam search reorders a
cache): every row's bytes are really stored (copies), only the synthetic contents repeat, which the decode
step's work does not depend on. The fill time of the encoder grows with B, so this keeps a B = 100 run
within minutes.
A method named ``NAME@graphs`` decodes pipeline NAME greedily with each block's steps replayed from a CUDA graph
(:func:`kvweave.engine.graphs.graph_decode`) instead of ``model.generate``; the step after each block's first also
captures the graph, and is timed with it. ``full@graphs`` is the full cache's own: transformers' StaticCache (room for
the decoded tokens, the mask over all of it) with its steps replayed from one CUDA graph (GPU only).
``--warm`` (``NAME@graphs`` methods only) times them after as many untimed steps over the same cache: a process's first
flush took 1.7 s against 0.29 s for its second at B = 130, and after a warm pass every flush took 0.25 s (2026-12-04,
docs/kernels.md "The query heads where the model left them"): a cost the process pays once.
``--ttft T`` times a real prefill of T random token ids to the first generated token, B = 1.
A pipeline whose evictor chooses by context importance (``kvzip-qa35v3``) is filled with random scores
(:mod:`kvweave.engine.synthetic`) and, for ``--ttft``, scores its prompt inside the timed span and stores it from the
scoring's own context pass (``kvweave.engine.ingest``), as ``kvweave generate`` does.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import time
from pathlib import Path

from kvweave.core.allocator import prefer_expandable_segments

prefer_expandable_segments()  # before torch starts CUDA: the flushes' store growth without allocator round trips

import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.graphs import graph_decode
from kvweave.core.registry import load_pipeline
from kvweave.engine.importance import score_whole
from kvweave.engine.synthetic import fill_cache

from bench_model import SHAPES, Ids, llama3_8b, random_model, smoke_config, sync  # noqa: F401 (the other scripts import them from here)


def peak_bytes() -> int:
    return torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0


class StepClock(StoppingCriteria):
    """Records the time after each generated token (synchronized), never stops generation."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.tick()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def tick(self) -> None:
        sync()
        self.times.append(time.perf_counter())


def static_full_cache(model, batch: int, tokens: int, steps: int, device: str) -> StaticCache:
    """transformers' StaticCache (room for ``tokens + steps + 1`` a row, what ``full@graphs`` replays steps over) holding
    ``tokens`` random bf16 K/V a row, written in chunks."""
    config = model.config
    cache = StaticCache(config=config, max_cache_len=tokens + steps + 1)
    for layer in cache.layers:
        for lo in range(0, tokens, 8192):
            k = torch.randn(batch, config.num_key_value_heads, min(8192, tokens - lo), config.head_dim, device=device, dtype=torch.bfloat16)
            layer.update(k, torch.randn_like(k))
    return cache


def full_cache(model, batch: int, tokens: int, device: str) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    config = model.config
    for layer in range(config.num_hidden_layers):
        k = torch.randn(batch, config.num_key_value_heads, tokens, config.head_dim, device=device, dtype=torch.bfloat16)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def cache_bytes(cache) -> int:
    if isinstance(cache, KVWeaveCache):
        return cache.memory_bytes()
    if isinstance(cache, StaticCache):  # the tokens held, not the room left for the decoded ones
        return sum(t[:, :, : int(layer.cumulative_length)].nbytes for layer in cache.layers for t in (layer.keys, layer.values))
    return sum(t.nbytes for layer in cache.layers for t in (layer.keys, layer.values) if t is not None)


REGISTRY: str | None = None  # a user registry read on top of the built-in one (--registry)


GRAPHS = "@graphs"  # a method's suffix: decoded with CUDA graphs


def make_cache(method: str, model, batch: int, tokens: int, device: str, fill_rows: int = 8, steps: int = 0):
    if method == "full" + GRAPHS:
        model.set_attn_implementation("sdpa")
        return static_full_cache(model, batch, tokens, steps, device)
    method = method.removesuffix(GRAPHS)
    if method == "full":
        model.set_attn_implementation("sdpa")
        return full_cache(model, batch, tokens, device)
    cache = build_cache(load_pipeline(method, REGISTRY), model, tokenizer=Ids(model.config.vocab_size))
    rows = min(batch, fill_rows)
    fill_cache(cache, rows, tokens, chunk=4096, device=device, seed=rows)
    if rows < batch:  # grow to B rows: each stored tensor is gathered to B real rows
        cache.engine.select_batch(torch.arange(batch) % rows)
    return cache


def generate_steps(model, cache, batch: int, tokens: int, steps: int, device: str, clock: StoppingCriteria) -> None:
    """``model.generate`` of ``steps`` tokens over ``cache``, which holds ``tokens`` per row (random ids, the last one
    fed), ``clock`` called after each step."""
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens + 1), device=device)
    with torch.no_grad():
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, min_new_tokens=steps,
            do_sample=False, stopping_criteria=StoppingCriteriaList([clock]), **cache_kwargs(model, cache),
        )


def graph_steps(model, cache, batch: int, steps: int, device: str, clock: StepClock) -> None:
    """``steps`` greedy steps over ``cache`` replayed from CUDA graphs (eagerly on a CPU), a random token fed first;
    ``clock`` ticks after each step, as ``model.generate``'s does (the first step, which builds and compiles, is left
    out by :func:`decode` in both)."""
    first = torch.randint(0, model.config.vocab_size, (batch, 1), device=device)
    if isinstance(cache, StaticCache):
        static_graph_steps(model, cache, first, steps, clock)
    else:
        graph_decode(model, cache, first, steps, on_step=clock.tick)


def static_graph_steps(model, cache: StaticCache, first, steps: int, clock: StepClock) -> None:
    """The full cache's own CUDA graph: greedy steps over a StaticCache (its writes and mask from a device counter), one
    eager step, the capture, then replays."""
    ids = first.clone()
    positions = torch.full_like(ids, int(cache.layers[0].cumulative_length))

    def step() -> None:
        logits = model(input_ids=ids, position_ids=positions, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits
        ids.copy_(logits[:, -1].argmax(-1, keepdim=True))
        positions.add_(1)

    with torch.inference_mode():
        step()
        clock.tick()
        graph = torch.cuda.CUDAGraph() if first.is_cuda else None  # a CPU (--smoke) runs the same steps eagerly
        if graph is not None:
            with torch.cuda.graph(graph):
                step()  # recorded, not run: the cache's counters move only in the replays
        for _ in range(steps - 1):
            graph.replay() if graph is not None else step()
            clock.tick()


def decode(model, cache, batch: int, tokens: int, steps: int, device: str, graphs: bool = False) -> dict:
    clock = StepClock()
    gc.collect()
    sync()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    if graphs:
        graph_steps(model, cache, batch, steps, device, clock)
    else:
        generate_steps(model, cache, batch, tokens, steps, device, clock)
    sync()
    stamps = [start] + clock.times
    steps_s = [b - a for a, b in zip(stamps, stamps[1:])][1:]  # the first step also builds the mask: left out
    slowest = sorted(range(len(steps_s)), key=lambda i: -steps_s[i])[:3]  # step numbers from 2: where flushes land
    median = sorted(steps_s)[len(steps_s) // 2]
    mean = sum(steps_s) / len(steps_s)
    stored = cache_bytes(cache)
    return {
        "median_step_ms": round(median * 1e3, 2), "mean_step_ms": round(mean * 1e3, 2),
        "tokens_per_s_median": round(batch / median, 1), "tokens_per_s_mean": round(batch / mean, 1),
        "peak_gb": round(peak_bytes() / 1e9, 2), "cache_gb": round(stored / 1e9, 3), "cache_bytes": stored,
        "slowest_steps_ms": {i + 2: round(steps_s[i] * 1e3, 1) for i in slowest},
    }


def run(method: str, model, batch: int, tokens: int, steps: int, device: str, fill_rows: int = 8, warm: bool = False) -> dict:
    """One method and batch: the cache filled, ``steps`` decode steps timed; ``warm`` (``NAME@graphs`` only): after as
    many untimed steps over the same cache, so what a process does once (Triton's compiles for the shapes a flush
    brings, the first captures) is out of the timed steps."""
    t = time.perf_counter()
    cache = make_cache(method, model, batch, tokens, device, fill_rows, 2 * steps if warm else steps)
    fill_s = time.perf_counter() - t
    result = {"method": method, "batch": batch, "context": tokens, "fill_s": round(fill_s, 1)}
    if method != "full" and batch > fill_rows:
        result["filled_rows"] = fill_rows
    if warm:
        graph_steps(model, cache, batch, steps, device, StepClock())
        sync()
        result["warm"] = True
    result.update(decode(model, cache, batch, tokens, steps, device, graphs=method.endswith(GRAPHS)))
    del cache
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(result, flush=True)
    if LOG is not None:
        with LOG.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
    return result


LOG: Path | None = None  # rows are appended here as they are measured (a long run keeps what it finished)


def first_token(model, cache, ids: torch.Tensor) -> int:
    """The prompt ``ids`` [1, T] into ``cache`` and its greedy first token. A pipeline that scores its prompt (KVzip, a
    surrogate) stores it from the scoring pass and takes the first token from that pass's logits, as
    kvweave.engine.generation.generate does for greedy decoding; any other cache by ``model.generate``."""
    with torch.no_grad():
        logits = score_whole(model, cache, ids) if isinstance(cache, KVWeaveCache) else None
        if logits is not None:
            return int(logits.argmax(-1)[0])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False,
                             **cache_kwargs(model, cache))
        return int(out[0, -1])


def ttft(method: str, model, tokens: int, device: str, reps: int = 2) -> dict:
    method = method.removesuffix(GRAPHS)  # the first token comes from a prefill either way
    times, peaks = [], []
    for _ in range(reps):
        ids = torch.randint(0, model.config.vocab_size, (1, tokens), device=device)
        if method == "full":
            model.set_attn_implementation("sdpa")
            cache = DynamicCache(config=model.config)
        else:
            cache = build_cache(load_pipeline(method, REGISTRY), model, tokenizer=Ids(model.config.vocab_size))
        sync()
        if torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        first_token(model, cache, ids)
        sync()
        times.append(time.perf_counter() - start)
        if torch.cuda.is_available():  # the prompt's peak above the weights (allocated, and held by the allocator)
            peaks.append((torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()))
        ratio = cache.compression_ratio() if isinstance(cache, KVWeaveCache) else 1.0
        del cache
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    result = {"method": method, "prompt": tokens, "ttft_s": round(min(times), 3), "ttft_all_s": [round(x, 3) for x in times], "ratio": round(ratio, 2)}
    if peaks:
        result["peak_allocated_gb"] = round(max(a for a, _ in peaks) / 2**30, 2)
        result["peak_reserved_gb"] = round(max(r for _, r in peaks) / 2**30, 2)
    print(result, flush=True)
    if LOG is not None:
        with LOG.open("a") as handle:
            handle.write(json.dumps(result) + "\n")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,depthweave-kv,depthweave-kv-reference-kernel")
    parser.add_argument("--context", type=int, default=65536)
    parser.add_argument("--batches", default="1,4,8", help="batch sizes decoded (\"\": none, e.g. with --ttft for the first token only)")
    parser.add_argument("--steps", type=int, default=40, help="decode steps (a block is compressed every 32)")
    parser.add_argument("--max-batch", action="store_true")
    parser.add_argument("--full-max-batch", type=int, default=12)
    parser.add_argument("--ttft", type=int, default=0, help="prompt tokens for the time-to-first-token test (0: skip)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--fill-rows", type=int, default=8, help="rows filled through the encoder; larger batches repeat them")
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same head shape on the CPU (checks the script)")
    parser.add_argument("--shape", default="llama3-8b", choices=list(SHAPES), help="the model: Llama-3-8B's, or d256 "
                        "(Gemma-2-9B's sizes and attention, 16 query heads on 8 KV heads at head_dim 256, as a Llama)")
    parser.add_argument("--registry", help="a user registry file read on top of the built-in one (e.g. benchmarks/dense_sweep.toml)")
    parser.add_argument("--warm", action="store_true", help="time each NAME@graphs method after as many untimed steps "
                        "(one-time compiles and captures left out)")
    parser.add_argument("--out", default="results/decode_e2e")
    args = parser.parse_args()
    unwarmed = [m for m in args.methods.split(",") if not m.endswith(GRAPHS)]
    if args.warm and unwarmed:
        parser.error(f"--warm takes NAME@graphs methods only (model.generate feeds a prompt the cache already holds, so a "
                     f"second pass cannot continue it): {', '.join(unwarmed)}")
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    global LOG, REGISTRY
    LOG = out / "rows.jsonl"
    REGISTRY = args.registry
    model = random_model(smoke_config(args.layers, args.shape) if args.smoke else SHAPES[args.shape](args.layers), device)
    weights_gb = torch.cuda.memory_allocated() / 1e9 if device == "cuda" else 0.0
    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9 if device == "cuda" else 0.0
    methods = args.methods.split(",")
    rows, ttfts = [], []
    if args.ttft:
        for method in dict.fromkeys(m.removesuffix(GRAPHS) for m in methods):  # each method's prompt once
            ttfts.append(ttft(method, model, args.ttft, device))
    for method in methods:
        for batch in [int(b) for b in args.batches.split(",") if b]:  # --batches "": the time to first token only
            steps = args.steps if "reference" not in method else max(4, args.steps // 4)
            rows.append(run(method, model, batch, args.context, steps, device, args.fill_rows, args.warm))
    if args.max_batch:
        for method in methods:
            if "reference" in method:
                continue
            if method == "full":
                candidates = [args.full_max_batch]
            else:
                measured = [r for r in rows if r["method"] == method]
                biggest = max(measured, key=lambda r: r["batch"])
                per_sequence = (biggest["peak_gb"] - weights_gb) / biggest["batch"]
                guess = int((total_gb * 0.95 - weights_gb) / per_sequence)
                candidates = [guess, int(guess * 0.85), int(guess * 0.7), int(guess * 0.5)]
            for batch in candidates:
                try:
                    row = run(method, model, batch, args.context, args.steps, device, args.fill_rows, args.warm)
                    row["max_batch"] = True
                    rows.append(row)
                    break
                except torch.cuda.OutOfMemoryError as exc:
                    print(f"{method} B={batch}: out of memory ({str(exc)[:120]})", flush=True)
                    rows.append({"method": method, "batch": batch, "oom": True})
                gc.collect()  # after the except block: the exception's frames no longer hold the cache
                torch.cuda.empty_cache()
    lines = [
        f"# model.generate, {args.shape} shape ({model.config.num_hidden_layers} layers, {model.config.num_attention_heads} q / "
        f"{model.config.num_key_value_heads} KV heads, d={model.config.head_dim}), random bf16 weights ({weights_gb:.1f} GB), "
        f"context {args.context}",
        f"# {datetime.date.today()} {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'} ({total_gb:.0f} GB) torch {torch.__version__}",
        "| method | B | median step (ms) | mean step (ms) | tok/s (median) | tok/s (mean) | cache (GB) | peak (GB) | fill (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("oom"):
            lines.append(f"| {r['method']} | {r['batch']} | out of memory | | | | | | |")
            continue
        mark = (" (max)" if r.get("max_batch") else "") + (" (warm)" if r.get("warm") else "")
        lines.append(
            f"| {r['method']} | {r['batch']}{mark} | {r['median_step_ms']} | {r['mean_step_ms']} | {r['tokens_per_s_median']} | "
            f"{r['tokens_per_s_mean']} | {r['cache_gb']} | {r['peak_gb']} | {r['fill_s']} |"
        )
    if ttfts:
        lines += ["", "| method | prompt | time to first token (s) | runs (s) | ratio | peak allocated / reserved (GB) |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {t['method']} | {t['prompt']} | {t['ttft_s']} | {t['ttft_all_s']} | {t['ratio']} | "
                  f"{t.get('peak_allocated_gb', '')} / {t.get('peak_reserved_gb', '')} |" for t in ttfts]
    (out / "decode_e2e.md").write_text("\n".join(lines) + "\n")
    (out / "decode_e2e.json").write_text(json.dumps({"weights_gb": weights_gb, "rows": rows, "ttft": ttfts}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
