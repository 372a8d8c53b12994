"""``kvweave eval speed``: time to first token, decode tokens/s, stored bytes and (on CUDA) peak memory of
one generation from a prompt of ``--speed-tokens`` essay tokens, after one untimed generation."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.tools.eval_context import Evaluation, essay_ids
from kvweave.tools.eval_folder import EvalError, RunFolder, single_cells


def run_speed(ev: Evaluation, tokens: int, new_tokens: int) -> dict[str, Any]:
    """One greedy generation of ``new_tokens`` from ``tokens`` essay tokens [1, T] per pipeline, batch 1."""
    ev.check_length(tokens, "--speed-tokens", new_tokens)
    if new_tokens < 2:
        raise EvalError(f"--speed-new-tokens must be at least 2 (decode speed needs a step after the first token), got {new_tokens}")
    ids = essay_ids(ev, tokens)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    warmed: list[bool] = []

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        if not warmed:  # first use of kernels at these shapes, allocator and caches: a whole untimed generation
            ev.answer(name, inputs, 4)
            warmed.append(True)
        cuda = ev.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(ev.device)
            torch.cuda.reset_peak_memory_stats(ev.device)
            before = torch.cuda.memory_allocated(ev.device)
        _, stats = ev.answer(name, inputs, new_tokens)
        record = {"ttft_seconds": stats.prefill_seconds, "decode_tokens_per_second": stats.decode_tokens_per_second,
                  "generated_tokens": stats.generated_tokens, "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes,
                  "breakdown": stats.breakdown}
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
