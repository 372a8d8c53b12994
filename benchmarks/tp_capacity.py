"""Capacity and decode speed of compressed caches on models spread over several GPUs (docs/scale-out.md).

    # Llama-3-8B shape, random bf16 weights, 64K context: one GPU, then heads sharded over two
    python benchmarks/tp_capacity.py tp --out results/tp/8b-1gpu
    torchrun --nproc-per-node 2 benchmarks/tp_capacity.py tp --out results/tp/8b-2gpu
    # Llama-3-70B shape (does not fit one GPU with its cache): layers split over the GPUs, or heads sharded
    python benchmarks/tp_capacity.py split --model 70b --contexts 32768,65536 --no-speed --out results/tp/70b-split
    torchrun --nproc-per-node 2 benchmarks/tp_capacity.py tp --model 70b --contexts 32768,65536 --no-speed --out results/tp/70b-tp
    # one table from every run, with the capacity check and the speed-up over one GPU
    python benchmarks/tp_capacity.py table results/tp/8b-1gpu results/tp/8b-2gpu results/tp/70b-split results/tp/70b-tp

Per method (``full``: a DynamicCache of the rank's heads, the model's sdpa; others: kvweave pipelines) and
context: the cache bytes of one sequence on the fullest GPU; the largest batch that decodes (from the peak
memory of two small batches, a linear fit per GPU, then checked by running it, stepping down on out of
memory); and the decode tokens/s at that batch (median step of ``--steps``). Caches are filled as in
``decode_e2e.py`` (random K/V for ``full``, synthetic cross-layer K/V through kvweave's own encoder for the
others, ``--fill-rows`` rows grown to the batch). Under ``torchrun`` every rank runs the same steps on its
own GPU; rank 0 prints and writes ``rows.jsonl`` and ``tp_capacity.md`` under ``--out``.
``--smoke``: a tiny model on the CPU (gloo under torchrun), memory counted as cache bytes against
``--smoke-limit``; it checks the script, it measures nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from decode_e2e import Ids, cache_bytes, decode, llama3_8b, make_cache, random_model
from kvweave.core.errors import KvweaveError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache
from kvweave.engine.cache import model_shape
from kvweave.engine.sharding import align_device_map, detect_head_shard, layer_devices
from kvweave.engine.synthetic import fill_cache


def llama3_70b(layers: int = 80) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=layers, num_attention_heads=64,
        num_key_value_heads=8, head_dim=128, rope_theta=500000.0, max_position_embeddings=262144, torch_dtype="bfloat16",
    )


def smoke_config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=layers,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=128)


# ------------------------------------------------------------------------------------------- ranks
def rank_and_size() -> tuple[int, int]:
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def gathered(value):
    """``value`` of every rank, in rank order (one all-gather; [value] without torchrun)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [value]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, value)
    return every


# ------------------------------------------------------------------------------------------- model
def split_map(config: LlamaConfig, gpus: int, groups: list[tuple[int, ...]]) -> dict:
    """Layers in equal consecutive parts over ``gpus`` GPUs (embeddings on the first, head on the last), each
    basis group kept on one GPU."""
    layers = config.num_hidden_layers
    placement = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1}
    placement.update({f"model.layers.{i}": min(i * gpus // layers, gpus - 1) for i in range(layers)})
    return align_device_map(placement, groups)


def build_model(args, config: LlamaConfig, size: int, device: str) -> LlamaForCausalLM:
    if size > 1:  # heads sharded by transformers' tensor-parallel plan, random weights, no checkpoint
        from transformers.distributed import DistributedConfig

        model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict={}, dtype=torch.bfloat16,
                                                 distributed_config=DistributedConfig(tp_size=size))
    elif args.mode == "split":
        shape = model_shape(config)
        groups = [g for name in args.methods.split(",") if name != "full"
                  for g in load_pipeline(name).component("basis").layer_groups(shape)]
        merged = sorted({g for g in groups}, key=lambda g: g[0])  # groups of every method: one placement fits all
        placement = split_map(config, torch.cuda.device_count() if torch.cuda.is_available() else 2, merged)
        if not torch.cuda.is_available():  # smoke: one CPU, the placement only recorded
            model = random_model(config, "cpu")
        else:
            model = LlamaForCausalLM.from_pretrained(None, config=config, state_dict={}, dtype=torch.bfloat16, device_map=placement)
        model.hf_device_map = placement
    else:
        model = random_model(config, device)
    model.config._attn_implementation = "sdpa"
    return model.eval()


def devices_of(model, device: str) -> list[torch.device]:
    """The GPUs this process's model uses (one per rank under torchrun; several when layers are split)."""
    if not torch.cuda.is_available():
        return [torch.device("cpu")]
    placed = layer_devices(model, model.config.num_hidden_layers)
    return sorted({d for d in placed}, key=str) if placed else [torch.device(device)]


# ------------------------------------------------------------------------------------------- caches
def full_cache(model, batch: int, tokens: int, device: str) -> DynamicCache:
    """Random K/V of this rank's KV heads, each layer on the device it computes on."""
    shape = model_shape(model.config)
    shard = detect_head_shard(model)
    heads = shape.num_kv_heads // (shard.size if shard else 1)
    placed = layer_devices(model, shape.num_layers) if torch.cuda.is_available() else None
    cache = DynamicCache(config=model.config)
    for layer in range(shape.num_layers):
        where = placed[layer] if placed else device
        k = torch.randn(batch, heads, tokens, shape.head_dim, device=where, dtype=torch.bfloat16)
        cache.update(k, torch.randn_like(k), layer)
    return cache


def new_cache(method: str, model, batch: int, tokens: int, device: str, fill_rows: int):
    if method == "full":
        model.set_attn_implementation("sdpa")
        return full_cache(model, batch, tokens, device)
    placed = layer_devices(model, model.config.num_hidden_layers) if torch.cuda.is_available() else None
    if not placed:  # one device per process: decode_e2e's fill (build_cache reads the rank's share of heads)
        return make_cache(method, model, batch, tokens, device, fill_rows)
    cache = build_cache(load_pipeline(method), model, tokenizer=Ids(model.config.vocab_size))
    rows = min(batch, fill_rows)
    fill_cache(cache, rows, tokens, chunk=4096, device=placed[0], seed=rows, layer_devices=placed)
    if rows < batch:
        cache.engine.select_batch(torch.arange(batch) % rows)
    return cache


def measure(args, model, method: str, batch: int, tokens: int, device: str, devices: list[torch.device], steps: int) -> dict | None:
    """Fill a cache of ``batch`` sequences and decode ``steps`` tokens; per GPU peak and cache bytes. None
    when any rank ran out of memory (every rank agrees)."""
    record, ok = None, True
    try:
        for d in devices:
            if d.type == "cuda":
                torch.cuda.reset_peak_memory_stats(d)
        before = [torch.cuda.memory_allocated(d) if d.type == "cuda" else 0 for d in devices]
        torch.manual_seed(0)  # every rank feeds the same ids
        cache = new_cache(method, model, batch, tokens, device, args.fill_rows)
        stored = [torch.cuda.memory_allocated(d) - b if d.type == "cuda" else cache_bytes(cache) for d, b in zip(devices, before)]
        record = decode(model, cache, batch, tokens, steps, device)
        peaks = [torch.cuda.max_memory_allocated(d) if d.type == "cuda" else s for d, s in zip(devices, stored)]
        record.update(cache_per_gpu=stored, peak_per_gpu=peaks)
        del cache
    except torch.cuda.OutOfMemoryError:
        ok = False
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record if all(gathered(ok)) else None


def largest_batch(args, model, method: str, tokens: int, device: str, devices, limit: list[int]) -> tuple[int, dict | None]:
    """The largest batch whose peak fits ``limit`` bytes on every GPU of every rank, and its measurement."""
    small, large = 1, max(2, args.probe_batch)
    one = measure(args, model, method, small, tokens, device, devices, 4)
    if one is None:
        return 0, None
    two = measure(args, model, method, large, tokens, device, devices, 4)
    fits = []
    twos = gathered(two) if two is not None else None  # None on every rank alike (measure agrees)
    for rank, rank_one in enumerate(gathered(one)):
        rank_two = twos[rank] if twos else None
        for gpu, (low, cap) in enumerate(zip(rank_one["peak_per_gpu"], limit)):
            # the slope of peak memory per sequence; without the second batch (it did not fit), one sequence's cache
            slope = (rank_two["peak_per_gpu"][gpu] - low) / (large - small) if rank_two else rank_one["cache_per_gpu"][gpu]
            fits.append(int(small + (cap - low) / max(slope, 1.0)))
    batch = max(1, min(fits))
    for _ in range(6):
        found = measure(args, model, method, batch, tokens, device, devices, args.steps)
        if found is not None or batch == 1:
            return batch, found
        batch = max(1, int(batch * 0.95))
    return 0, None


# ------------------------------------------------------------------------------------------- run
def run(args) -> None:
    rank, size = rank_and_size()
    smoke = args.smoke or not torch.cuda.is_available()
    device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and args.mode == "tp" else ("cuda:0" if torch.cuda.is_available() else "cpu")
    config = smoke_config(args.layers or 2) if smoke else (llama3_70b(args.layers or 80) if args.model == "70b" else llama3_8b(args.layers or 32))
    model = build_model(args, config, size, device)
    devices = devices_of(model, device)
    weights = [torch.cuda.memory_allocated(d) if d.type == "cuda" else 0 for d in devices]
    limit = [int(torch.cuda.get_device_properties(d).total_memory * args.memory_fraction) if d.type == "cuda" else args.smoke_limit
             for d in devices]
    gpus = size * len(devices) if torch.cuda.is_available() else size * (2 if args.mode == "split" else 1)
    out = Path(args.out)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for tokens in [int(t) for t in args.contexts.split(",")]:
        for method in args.methods.split(","):
            row = {"model": "smoke" if smoke else args.model, "mode": args.mode, "gpus": gpus, "method": method, "context": tokens,
                   "weights_gb_per_gpu": round(max(weights) / 1e9, 2), "date": str(datetime.date.today())}
            try:
                batch, found = largest_batch(args, model, method, tokens, device, devices, limit)
            except KvweaveError as exc:  # a pipeline that cannot run on this placement (e.g. mixes heads under --tp)
                row["refused"] = str(exc)
                batch, found = 0, None
            if found is not None:
                every = gathered(found)
                per_gpu = [b for r in every for b in r["cache_per_gpu"]]
                row.update(max_batch=batch, seq_bytes_per_gpu=max(per_gpu) // batch, cache_bytes_total=sum(per_gpu),
                           peak_gb_per_gpu=round(max(p for r in every for p in r["peak_per_gpu"]) / 1e9, 2))
                if not args.no_speed:
                    row.update(tokens_per_s=found["tokens_per_s_median"], median_step_ms=found["median_step_ms"])
            elif "refused" not in row:
                row["max_batch"] = 0
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
                with (out / "rows.jsonl").open("a") as handle:
                    handle.write(json.dumps(row) + "\n")
    if rank == 0:
        (out / "tp_capacity.md").write_text(table(rows) + "\n")
        print(table(rows))


def table(rows: list[dict]) -> str:
    """One Markdown table: per model, context and GPU count, each method's batch, bytes and speed; the
    capacity gain over ``full`` on the same GPUs against its bytes ratio (it should be >= 0.9x), and the
    decode speed against the same method on one GPU."""
    lines = ["| model | mode | GPUs | context | method | max batch | seq bytes / GPU | tok/s | gain vs full | bytes ratio | "
             "gain / ratio | tok/s vs 1 GPU |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "refused" in row:
            lines.append(f"| {row['model']} | {row['mode']} | {row['gpus']} | {row['context']} | {row['method']} | refused: "
                         f"{row['refused'][:80]} | | | | | | |")
            continue
        same = [r for r in rows if r.get("method") == "full" and "refused" not in r and
                all(r[k] == row[k] for k in ("model", "mode", "gpus", "context"))]
        full = same[0] if same else None
        gain = ratio = check = ""
        if full and full.get("max_batch") and row.get("max_batch") and row["method"] != "full":
            gain = row["max_batch"] / full["max_batch"]
            ratio = full["seq_bytes_per_gpu"] / row["seq_bytes_per_gpu"]
            check = f"{gain / ratio:.2f} {'ok' if gain >= 0.9 * ratio else 'BELOW 0.9'}"
            gain, ratio = f"{gain:.1f}x", f"{ratio:.1f}x"
        alone = [r for r in rows if r["gpus"] == 1 and r["method"] == row["method"] and r["context"] == row["context"]
                 and r["model"] == row["model"] and r.get("tokens_per_s")]
        speedup = f"{row['tokens_per_s'] / alone[0]['tokens_per_s']:.2f}x" if alone and row.get("tokens_per_s") and row["gpus"] > 1 else ""
        seq = f"{row['seq_bytes_per_gpu']:,}" if "seq_bytes_per_gpu" in row else ""
        lines.append(f"| {row['model']} | {row['mode']} | {row['gpus']} | {row['context']} | {row['method']} | {row.get('max_batch', '')} | "
                     f"{seq} | {row.get('tokens_per_s', '')} | {gain} | {ratio} | {check} | {speedup} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=("tp", "split", "table"), help="tp: heads sharded over the torchrun processes (1: one "
                        "GPU); split: layers over the visible GPUs; table: merge earlier --out folders")
    parser.add_argument("folders", nargs="*", help="with 'table': the --out folders of earlier runs")
    parser.add_argument("--model", choices=("8b", "70b"), default="8b")
    parser.add_argument("--methods", default="full,depthweave-kv,prerope-k4v2,kivi-2")
    parser.add_argument("--contexts", default="65536", help="comma-separated context lengths")
    parser.add_argument("--steps", type=int, default=40, help="decode steps timed at the largest batch (a block is compressed every 32)")
    parser.add_argument("--probe-batch", type=int, default=4, help="the second small batch the memory fit is measured at")
    parser.add_argument("--fill-rows", type=int, default=8, help="rows filled through the encoder; larger batches repeat them")
    parser.add_argument("--memory-fraction", type=float, default=0.95, help="share of each GPU's memory a batch may peak at")
    parser.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's own)")
    parser.add_argument("--no-speed", action="store_true", help="capacity only (the decode is still run to check the batch)")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on the CPU: checks the script")
    parser.add_argument("--smoke-limit", type=int, default=8_000_000, help="with --smoke: the bytes a rank's cache may hold")
    parser.add_argument("--out", default="results/tp_capacity")
    args = parser.parse_args()
    if args.mode == "table":
        rows = [json.loads(line) for folder in args.folders for line in (Path(folder) / "rows.jsonl").read_text().splitlines()]
        print(table(rows))
        return
    run(args)


if __name__ == "__main__":
    main()
