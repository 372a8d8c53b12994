"""``kvweave eval qa``: extractive QA (HotpotQA distractor setting, SQuAD v2 answerable questions) over
long contexts padded with distractor paragraphs; exact match and F1 as those datasets define them."""

from __future__ import annotations

from typing import Any

from kvweave.tools import datasets, scoring
from kvweave.tools.eval_context import Evaluation
from kvweave.tools.eval_folder import EvalError, RunFolder, mean


def run_qa(ev: Evaluation, names: list[str], samples: int, length: int) -> dict[str, Any]:
    """``samples`` questions of each dataset in ``names``, contexts padded to ``length`` tokens, answered
    greedily by every pipeline; EM and F1 per dataset in ``qa.json``."""
    unknown = [n for n in names if n not in datasets.QA_BUILDERS]
    if unknown:
        raise EvalError(f"unknown QA datasets {unknown}; known: {', '.join(datasets.QA_BUILDERS)}")
    if samples < 1:
        raise EvalError(f"--qa-samples must be at least 1, got {samples}")
    ev.check_length(length, "QA context length")
    built = {name: datasets.QA_BUILDERS[name](ev.tokenizer, samples, length, ev.seed) for name in names}
    by_id = {(d, s.id): s for d, items in built.items() for s in items}

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        dataset, sample_id = cell
        sample = by_id[(dataset, sample_id)]
        answer, stats = ev.answer(name, ev.encode_prompt(datasets.qa_prompt(sample)))
        prediction = scoring.clean_prediction(answer)
        em, f1 = scoring.best_scores(prediction, sample.answers)
        return {"dataset": dataset, "id": sample_id, "question": sample.question, "answers": list(sample.answers),
                "answer": answer, "prediction": prediction, "em": em, "f1": f1, "prompt_tokens": stats.prompt_tokens,
                "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes}

    cells = [(name, (dataset, s.id)) for name in ev.pipelines for dataset in names for s in built[dataset]]
    ev.run_cells("qa", cells, work)
    return qa_result(ev.run, ev.pipelines, ev.errors, names, samples, length, wanted=set(by_id))


def qa_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], names: list[str], samples: int, length: int,
              wanted: set[tuple[str, str]] | None = None) -> dict[str, Any]:
    """qa.json from the run folder's cells (``wanted``: the (dataset, id) pairs of this run; None: all)."""
    result: dict[str, Any] = {"datasets": names, "samples": samples, "length": length, "pipelines": {}}
    for name in pipelines:
        rows = [r for r in run.records("qa", name) if r["dataset"] in names and (wanted is None or (r["dataset"], r["id"]) in wanted)]
        if name in errors or not rows:
            result["pipelines"][name] = {"error": errors.get(name, "not run")}
            continue
        entry: dict[str, Any] = {}
        for dataset in names:
            part = [r for r in rows if r["dataset"] == dataset]
            entry[dataset] = {"em": mean(r["em"] for r in part), "f1": mean(r["f1"] for r in part), "n": len(part)}
        entry["answers"] = rows
        result["pipelines"][name] = entry
    run.write_json("qa.json", result)
    return result
