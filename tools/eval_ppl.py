"""``kvweave eval ppl``: perplexity of essay text fed in chunks (the cache compresses as it fills),
against a DynamicCache fed identically (the reference, one cell of its own).

``--prefill P``: the first ``P`` tokens are one forward (a context, compressed after it; scored first for
an evictor that chooses by context importance, which needs it) and perplexity counts the tokens after
them only, for every pipeline and the reference alike."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.engine.importance import needs_importance
from kvweave.tools import metrics
from kvweave.tools.eval_context import Evaluation, essay_ids
from kvweave.tools.eval_folder import EvalError, RunFolder, key, single_cells


def cell_of(tokens: int, chunk: int, prefill: int) -> tuple[int, ...]:
    """A ppl cell's key fields (runs without a prefill keep the key they always had)."""
    return (tokens, chunk, prefill) if prefill else (tokens, chunk)


def run_ppl(ev: Evaluation, tokens: int, chunk: int, prefill: int = 0) -> dict[str, Any]:
    """Perplexity of ``tokens`` essay tokens [1, T] fed in ``chunk``-token forwards (after a ``prefill``-token
    forward, when set) into each pipeline's cache and into a DynamicCache (the reference); writes ``ppl.json``."""
    ev.check_length(tokens, "--tokens", 0)
    if not 1 <= chunk <= tokens:
        raise EvalError(f"--chunk must be in 1..{tokens}, got {chunk}")
    if not 0 <= prefill < tokens - 1:
        raise EvalError(f"--prefill must be in 0..{tokens - 2} (tokens after it are scored), got {prefill}")
    ids = essay_ids(ev, tokens)
    cell = cell_of(tokens, chunk, prefill)
    reference_key = key("ppl", "DynamicCache", *cell)
    if ev.run.get(reference_key) is None:
        ev.say("perplexity with a DynamicCache (the reference)")
        ev.run.add(reference_key, {"task": "ppl", "pipeline": "DynamicCache", "ppl": metrics.perplexity(ev.model, None, ids, chunk, prefill)})
    reference = ev.run.get(reference_key)["ppl"]
    if not prefill:
        for name in ev.pipelines:
            resolved = ev.pipeline(name)
            if resolved is not None and needs_importance(resolved):
                ev.errors[name] = (f"pipeline '{name}' scores a context before compressing it (its evictor chooses by context "
                                   "importance); measure its perplexity with --prefill N (the context's tokens)")
                ev.say(f"{name}: skipped: {ev.errors[name]}")

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        torch.manual_seed(ev.seed)
        cache = ev.cache(name)
        ppl = metrics.perplexity(ev.model, cache, ids, chunk, prefill)
        return {"ppl": ppl, "ppl_delta": ppl - reference, "stored_bytes": cache.memory_bytes(),
                "full_16bit_bytes": cache.full_cache_bytes_16bit(), "breakdown": cache.memory_breakdown()}

    ev.run_cells("ppl", [(name, cell) for name in ev.pipelines], work)
    return ppl_result(ev.run, ev.pipelines, ev.errors, tokens, chunk, prefill)


def ppl_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], tokens: int, chunk: int, prefill: int = 0) -> dict[str, Any]:
    """ppl.json from the run folder's cells (``dynamic_cache_ppl`` None until the reference ran)."""
    cell = cell_of(tokens, chunk, prefill)
    reference = run.get(key("ppl", "DynamicCache", *cell))
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "prefill": prefill, "dynamic_cache_ppl": reference and reference["ppl"],
                              "pipelines": {}}
    result["pipelines"] = single_cells(run, "ppl", pipelines, errors, *cell)
    run.write_json("ppl.json", result)
    return result
