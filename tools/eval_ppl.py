"""``kvweave eval ppl``: perplexity of essay text fed in chunks (the cache compresses as it fills),
against a DynamicCache fed identically (the reference, one cell of its own)."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.tools import metrics
from kvweave.tools.eval_context import Evaluation, essay_ids
from kvweave.tools.eval_folder import EvalError, RunFolder, key, single_cells


def run_ppl(ev: Evaluation, tokens: int, chunk: int) -> dict[str, Any]:
    """Perplexity of ``tokens`` essay tokens [1, T] fed in ``chunk``-token forwards into each pipeline's cache
    and into a DynamicCache (the reference); writes ``ppl.json``."""
    ev.check_length(tokens, "--tokens", 0)
    if not 1 <= chunk <= tokens:
        raise EvalError(f"--chunk must be in 1..{tokens}, got {chunk}")
    ids = essay_ids(ev, tokens)
    reference_key = key("ppl", "DynamicCache", tokens, chunk)
    if ev.run.get(reference_key) is None:
        ev.say("perplexity with a DynamicCache (the reference)")
        ev.run.add(reference_key, {"task": "ppl", "pipeline": "DynamicCache", "ppl": metrics.perplexity(ev.model, None, ids, chunk)})
    reference = ev.run.get(reference_key)["ppl"]

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        torch.manual_seed(ev.seed)
        cache = ev.cache(name)
        ppl = metrics.perplexity(ev.model, cache, ids, chunk)
        return {"ppl": ppl, "ppl_delta": ppl - reference, "stored_bytes": cache.memory_bytes(),
                "full_16bit_bytes": cache.full_cache_bytes_16bit(), "breakdown": cache.memory_breakdown()}

    ev.run_cells("ppl", [(name, (tokens, chunk)) for name in ev.pipelines], work)
    return ppl_result(ev.run, ev.pipelines, ev.errors, tokens, chunk)


def ppl_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], tokens: int, chunk: int) -> dict[str, Any]:
    """ppl.json from the run folder's cells (``dynamic_cache_ppl`` None until the reference ran)."""
    reference = run.get(key("ppl", "DynamicCache", tokens, chunk))
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "dynamic_cache_ppl": reference and reference["ppl"], "pipelines": {}}
    result["pipelines"] = single_cells(run, "ppl", pipelines, errors, tokens, chunk)
    run.write_json("ppl.json", result)
    return result
