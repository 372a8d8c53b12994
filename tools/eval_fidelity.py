"""``kvweave eval fidelity``: Eq. (3) attention-output relative error per layer and overall (see
:func:`kvweave.tools.metrics.attention_output_error`); ``fidelity.json`` and ``fidelity.png``."""

from __future__ import annotations

from typing import Any

import torch

from kvweave.tools import metrics
from kvweave.tools.eval_context import Evaluation, essay_ids, model_label
from kvweave.tools.eval_folder import EvalError, RunFolder, single_cells
from kvweave.tools.eval_report import fidelity_plot


def run_fidelity(ev: Evaluation, tokens: int, chunk: int, probe: int) -> dict[str, Any]:
    """Eq. (3) for each pipeline after ``tokens`` essay tokens [1, T] (half a prefill, then ``chunk``-token
    forwards), the last ``probe`` positions' queries of one DynamicCache reference pass shared by all."""
    ev.check_length(tokens, "--tokens", 0)
    if not 1 <= probe <= tokens:
        raise EvalError(f"--probe must be in 1..{tokens}, got {probe}")
    if not 1 <= chunk <= tokens:
        raise EvalError(f"--chunk must be in 1..{tokens}, got {chunk}")
    ids = essay_ids(ev, tokens)
    reference: dict[str, Any] = {}

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        if not reference:
            ev.say("reference pass (DynamicCache) for the attention-output error")
            reference.update(metrics.reference_pass(ev.model, ids.to(ev.device), chunk, tokens // 2, probe))
        torch.manual_seed(ev.seed)
        out = metrics.attention_output_error(ev.model, ev.tokenizer, ev.pipeline(name), ids, ev.device, chunk=chunk, probe=probe,
                                             reference=reference)
        return {"error": out["mean"], "per_layer": out["per_layer"], "per_head": out["per_head"], "stored_bytes": out["memory_bytes"],
                "full_16bit_bytes": out["full_16bit_bytes"], "breakdown": out["breakdown"]}

    ev.run_cells("fidelity", [(name, (tokens, chunk, probe)) for name in ev.pipelines], work)
    return fidelity_result(ev.run, ev.pipelines, ev.errors, model_label(ev.model), tokens, chunk, probe)


def fidelity_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], label: str, tokens: int, chunk: int,
                    probe: int) -> dict[str, Any]:
    """fidelity.json (error, per_layer [L], per_head [L][H] per pipeline) and fidelity.png from the cells."""
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "probe": probe,
                              "pipelines": single_cells(run, "fidelity", pipelines, errors, tokens, chunk, probe)}
    run.write_json("fidelity.json", result)
    fidelity_plot(run.path / "fidelity.png", result, label)
    return result
