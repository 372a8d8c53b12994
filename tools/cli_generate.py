"""``kvweave generate``: answer a prompt with a pipeline's cache and print what it stored."""

from __future__ import annotations

import argparse
import math
from typing import Any

from kvweave.core.errors import KvweaveError
from kvweave.tools.cli_io import print_json, read_text_file


#: what each part of the stored bytes is (printed under the stats of `kvweave generate`)
BREAKDOWN_TERMS = {
    "exact_window": "the most recent tokens, kept as computed (in the model's dtype; int8 with window_storage = 'int8')",
    "sliding_window": "sliding-window layers: their last window - 1 tokens, kept as computed, as the model's own cache does",
    "coefficients": "the packed (quantized / projected) keys and values of the compressed tokens",
    "residuals": "routed corrections of chosen tokens, with their indices and scales",
    "basis_state": "shared bases the coefficients decode with",
    "observation": "recent queries and token flags kept for the router or probe",
    "eviction": "cache positions of the kept tokens (and accumulated attention, H2O)",
}



def check_sampling(args: argparse.Namespace) -> None:
    """``--temperature`` and ``--top-p`` in range (checked with or without ``--sample``, so that a wrong
    value is never accepted silently)."""
    greedy = "" if args.sample else " (it only matters with --sample; leave it out for greedy decoding)"
    if not (math.isfinite(args.temperature) and args.temperature > 0):
        raise KvweaveError(
            f"--temperature must be a number > 0 (sampling divides the logits by it), got {args.temperature}"
            + (greedy or "; for greedy decoding leave out --sample")
        )
    if not (math.isfinite(args.top_p) and 0 < args.top_p <= 1):
        raise KvweaveError(
            f"--top-p must be in (0, 1] (the probability mass sampling keeps; 1 keeps every token), got {args.top_p}{greedy}"
        )


def check_context(prompt_tokens: int, new_tokens: int, limit: int | None, model: str) -> None:
    """A prompt of ``prompt_tokens`` plus ``new_tokens`` generated must fit the model's context ``limit``."""
    if prompt_tokens < 1:
        raise KvweaveError("the prompt is empty after tokenization; give some text with --prompt or --prompt-file")
    if limit is not None and prompt_tokens + new_tokens > limit:
        room = limit - new_tokens
        fix = f"shorten the prompt to at most {room:,} tokens or lower --max-new-tokens" if room > 0 else "lower --max-new-tokens"
        raise KvweaveError(
            f"the prompt is {prompt_tokens:,} tokens and --max-new-tokens {new_tokens:,} would make {prompt_tokens + new_tokens:,}, "
            f"more than the context of model {model} ({limit:,} tokens, max_position_embeddings in its config); {fix}"
        )


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise KvweaveError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    check_sampling(args)
    if args.prompt_file is not None:
        prompt = read_text_file(args.prompt_file, "--prompt-file")
        where = f"--prompt-file {args.prompt_file}"
    else:
        prompt = args.prompt
        where = "--prompt"
    if not args.chat and not prompt.strip():
        raise KvweaveError(
            f"{where} is empty; with --no-chat the model continues the prompt's text, so it needs some "
            "(without --no-chat it is sent as a chat message)"
        )
    if args.cuda_graphs:  # what the cache cannot replay is refused by generate, before the prefill
        wrong = [f"--device {args.device}"] if args.device.split(":")[0] != "cuda" else []
        wrong += ["--sample"] if args.sample else []
        wrong += [f"--tp {args.tp}"] if getattr(args, "tp", 1) > 1 else []
        if wrong:
            raise KvweaveError(f"--cuda-graphs replays greedy decode steps on one GPU (--device cuda, no --sample, no --tp); "
                               f"got {', '.join(wrong)}")
    from kvweave.core.registry import load_registry

    pipeline = load_registry(args.registry).resolve(args.pipeline)  # fail before loading any model
    import torch

    from kvweave.engine.generation import generate
    from kvweave.engine.pipeline import build_cache
    from kvweave.tools.distributed import TensorParallel
    from kvweave.tools.models import check_device

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    check_device(args.device)
    tp = TensorParallel.start(getattr(args, "tp", 1), args.device)
    try:
        model, tokenizer = tp.load_model(args.model, device=args.device, dtype=dtype)
        cache = build_cache(pipeline, model, tokenizer=tokenizer)
        return _generate(args, prompt, model, tokenizer, cache, generate, tp.main)
    finally:
        tp.finish()


def _generate(args: argparse.Namespace, prompt: str, model: Any, tokenizer: Any, cache: Any, generate: Any, main: bool) -> int:
    """Generate from ``prompt`` with ``cache`` and print the text and stats (only where ``main``: rank 0)."""
    import torch

    from kvweave.tools.models import context_limit

    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).to(model.device)
    check_context(inputs["input_ids"].shape[-1], args.max_new_tokens, context_limit(model), args.model)
    options: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "pad_token_id": tokenizer.pad_token_id}
    if args.sample:
        torch.manual_seed(args.seed)
        options.update(do_sample=True, temperature=args.temperature, top_p=args.top_p)
    else:
        options.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    if args.cuda_graphs:
        options["cuda_graphs"] = True
    new_tokens, stats = generate(model, inputs, cache, **options)
    completion = tokenizer.decode(new_tokens[0], skip_special_tokens=True)
    if not main:
        return 0
    if args.json:
        data = stats.to_dict()
        breakdown = data.get("breakdown") or {}
        data["breakdown_terms"] = {part: BREAKDOWN_TERMS[part] for part in breakdown if part in BREAKDOWN_TERMS}
        print_json({"model": args.model, "text": completion, "stats": data})
        return 0
    print(completion.strip())
    print()
    print(f"--- kvweave: pipeline {stats.pipeline}, model {args.model}, device {args.device}")
    print(f"prompt tokens        {stats.prompt_tokens}")
    print(f"generated tokens     {stats.generated_tokens}")
    print(f"stored KV bytes      {stats.stored_bytes:,}  ({', '.join(f'{k} {v:,}' for k, v in stats.breakdown.items() if v)})")
    if stats.rank_bytes:
        print(f"  per rank           {', '.join(f'{b:,}' for b in stats.rank_bytes)}  ({len(stats.rank_bytes)} tensor-parallel ranks, "
              "each holding its share of the KV heads)")
    print(f"16-bit full cache    {stats.full_16bit_bytes:,}  ({stats.cached_tokens} tokens)")
    ratio = f"{stats.ratio:.2f}x vs a 16-bit cache"
    if stats.model_dtype not in ("bfloat16", "float16"):
        ratio += f", {stats.ratio_model_dtype:.2f}x vs this model's {stats.model_dtype} cache"
    print(f"ratio                {ratio}")
    scoring = f"  (of which scoring the context {stats.scoring_seconds:.2f} s)" if stats.scoring_seconds >= 0.005 else ""
    print(f"prefill              {stats.prefill_seconds:.2f} s{scoring}")
    print(f"decode               {stats.decode_tokens_per_second:.1f} tokens/s")
    for part, value in stats.breakdown.items():
        if value and part in BREAKDOWN_TERMS:
            print(f"  {part:18s} {BREAKDOWN_TERMS[part]}")
    return 0
