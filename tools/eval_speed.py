"""``kvweave eval speed``: time to first token, decode tokens/s, stored bytes and (on CUDA) peak memory of
one generation from a prompt of ``--speed-tokens`` essay tokens, after one untimed generation (``--speed-cuda-graphs``:
the decode steps from CUDA graphs where the pipeline allows it)."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.engine.graphs import MIN_GRAPH_STEPS, graph_refusal
from kvweave.tools.eval_context import Evaluation, essay_ids
from kvweave.tools.eval_folder import EvalError, RunFolder, single_cells


def run_speed(ev: Evaluation, tokens: int, new_tokens: int, cuda_graphs: bool = False) -> dict[str, Any]:
    """One greedy generation of ``new_tokens`` from ``tokens`` essay tokens [1, T] per pipeline, batch 1; with
    ``cuda_graphs`` the decode steps of each pipeline that allows it from CUDA graphs (each record says how it decoded
    and, where it could not, why)."""
    ev.check_length(tokens, "--speed-tokens", new_tokens)
    if new_tokens < 2:
        raise EvalError(f"--speed-new-tokens must be at least 2 (decode speed needs a step after the first token), got {new_tokens}")
    ids = essay_ids(ev, tokens)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    warmed: set[bool] = set()

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        refusal = graph_refusal(ev.cache(name)) if cuda_graphs else None
        graphs = cuda_graphs and refusal is None
        if graphs not in warmed:  # first use of kernels at these shapes, allocator and caches: a whole untimed generation
            ev.answer(name, inputs, 2 * MIN_GRAPH_STEPS if graphs else 4, cuda_graphs=graphs)  # graphs: steps enough for one
            warmed.add(graphs)
        cuda = ev.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(ev.device)
            torch.cuda.reset_peak_memory_stats(ev.device)
            before = torch.cuda.memory_allocated(ev.device)
        _, stats = ev.answer(name, inputs, new_tokens, cuda_graphs=graphs)
        record = {"ttft_seconds": stats.prefill_seconds, "decode_tokens_per_second": stats.decode_tokens_per_second,
                  "generated_tokens": stats.generated_tokens, "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes,
                  "breakdown": stats.breakdown}
        if cuda_graphs:
            record["decoded"] = "cuda graphs" if graphs else "eager"
            if refusal is not None:
                record["eager_because"] = refusal
        if cuda:
            record["peak_extra_bytes"] = torch.cuda.max_memory_allocated(ev.device) - before
        return record

    ev.run_cells("speed", [(name, (tokens, new_tokens)) for name in ev.pipelines], work)
    return speed_result(ev.run, ev.pipelines, ev.errors, tokens, new_tokens)


def speed_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], tokens: int, new_tokens: int) -> dict[str, Any]:
    """speed.json from the run folder's cells."""
    result: dict[str, Any] = {"tokens": tokens, "new_tokens": new_tokens,
                              "pipelines": single_cells(run, "speed", pipelines, errors, tokens, new_tokens)}
    run.write_json("speed.json", result)
    return result
