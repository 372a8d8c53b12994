"""``kvweave eval``: the papers' measurements for any pipeline and model, resumable, in a results folder.

The commands (their command line is :mod:`kvweave.tools.eval_args`), ``table`` and ``report``. Tasks (each a subcommand, each a module;
``table`` runs several and assembles them):

* ``needle`` (:mod:`kvweave.tools.eval_needle`): needle in a haystack over context lengths x depths x
  distinct needles; greedy answers, a hit when the expected value occurs in the answer; a heatmap per pipeline.
  Query-agnostic by default (the context is prefilled and compressed before the question is read;
  ``--query-aware``: one prefill of the whole prompt); ``--keys K`` hides K facts and asks one.
* ``qa`` (:mod:`kvweave.tools.eval_qa`): extractive QA (HotpotQA distractor setting, SQuAD v2 answerable
  questions) over long contexts padded with distractor paragraphs; exact match and F1 as those datasets define them.
* ``ppl`` (:mod:`kvweave.tools.eval_ppl`): perplexity of essay text fed in chunks (the cache compresses as
  it fills), against a DynamicCache fed identically.
* ``fidelity`` (:mod:`kvweave.tools.eval_fidelity`): Eq. (3) attention-output relative error per layer and
  overall (see :func:`kvweave.tools.metrics.attention_output_error`).
* ``speed`` (:mod:`kvweave.tools.eval_speed`): time to first token, decode tokens/s, stored bytes and (on
  CUDA) peak memory of one generation from a prompt of ``--speed-tokens`` tokens.

The run folder and resume are :mod:`kvweave.tools.eval_folder`, what a task works with
:mod:`kvweave.tools.eval_context`, the plots and the table :mod:`kvweave.tools.eval_report`.

Progress goes to stderr; at the end stdout gets a table of the per-pipeline results and the results folder,
or with ``--json`` one JSON object (the settings, the folder, pipelines that could not be built, and each
task's results as its ``<task>.json`` holds them).
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import torch

from kvweave.core.registry import Registry, load_registry
from kvweave.tools.cli_io import print_json
from kvweave.tools.eval_context import Evaluation, model_label
from kvweave.tools.eval_fidelity import fidelity_result, run_fidelity
from kvweave.tools.eval_folder import EvalError, RunFolder
from kvweave.tools.eval_merge import merge
from kvweave.tools.eval_needle import QUERY_AGNOSTIC, QUERY_AWARE, needle_note, needle_result, run_needle
from kvweave.tools.eval_ppl import ppl_result, run_ppl
from kvweave.tools.eval_qa import qa_result, run_qa
from kvweave.tools.eval_report import ratio_note, render_table, table_rows, write_table
from kvweave.tools.eval_speed import run_speed, speed_result

TASKS = ("needle", "qa", "ppl", "fidelity", "speed")
DTYPES = ("auto", "float32", "bfloat16", "float16")


def resolve_dtype(dtype: str, device: str) -> str:
    """``--dtype`` as the model is loaded: ``auto`` is float32 on a CPU and bfloat16 on CUDA (as in
    ``kvweave generate``); the run folder records this name, so ``auto`` resumes a bfloat16 GPU run."""
    if dtype not in DTYPES:
        raise EvalError(f"--dtype {dtype!r} is not supported; accepted: {', '.join(DTYPES)}")
    if dtype != "auto":
        return dtype
    return "float32" if device == "cpu" else "bfloat16"


def ablation_pipelines(registry: Registry, base: str) -> list[str]:
    """``full``, ``base`` and every pipeline whose ``extends`` chain reaches ``base``."""
    if base not in registry.names():
        raise EvalError(f"--ablations {base}: no such pipeline; known: {', '.join(registry.names())}")
    children = [name for name in registry.names() if name != base and base in registry.resolve(name).chain]
    if not children:
        raise EvalError(f"--ablations {base}: no pipeline extends '{base}'")
    return list(dict.fromkeys(["full", base, *children]))


# -------------------------------------------------------------------------------------------- CLI
def split_names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _task_settings(args: argparse.Namespace, task: str) -> dict[str, Any]:
    if task == "needle":
        return {"lengths": args.lengths, "depths": args.depths, "needles": args.needles,
                "protocol": QUERY_AWARE if args.query_aware else QUERY_AGNOSTIC, "keys": args.keys}
    if task == "qa":
        return {"datasets": args.datasets, "qa_samples": args.qa_samples, "qa_length": args.qa_length}
    if task in ("ppl", "fidelity"):
        extra = {"probe": args.probe} if task == "fidelity" else ({"prefill": args.prefill} if args.prefill else {})
        return {"tokens": args.tokens, "chunk": args.chunk, **extra}
    graphs = {"cuda_graphs": True} if args.speed_cuda_graphs else {}  # absent otherwise: folders made before it still match
    return {"speed_tokens": args.speed_tokens, "speed_new_tokens": args.speed_new_tokens, **graphs}


def _model_label_for(spec: str) -> str:
    """The model's name in tables and plots: SmolLM2-135M-Instruct for ``default``, else the folder or file name."""
    from kvweave.tools.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if spec == DEFAULT_MODEL else Path(spec.rstrip("/")).name


def _model_slug(spec: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", _model_label_for(spec).lower()).strip("-") or "model"


def command_line(argv: list[str] | None) -> str:
    return shlex.join(["kvweave", *(sys.argv[1:] if argv is None else argv)])


def cmd_eval(args: argparse.Namespace) -> int:
    from kvweave.tools.eval_checks import check_settings
    from kvweave.tools.models import check_device

    registry = load_registry(args.registry)
    tasks = [args.task] if args.task != "table" else split_names(args.tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad or not tasks:
        raise EvalError(f"--tasks {bad or '(none given)'} unknown; tasks are {', '.join(TASKS)}")
    base = getattr(args, "ablations", None)
    if base is not None:
        names = ablation_pipelines(registry, base)
    else:
        names = split_names(args.pipelines)
    unknown = [n for n in names if n not in registry.names()]
    if unknown or not names:
        raise EvalError(f"unknown pipelines {unknown or '(none given)'}; known: {', '.join(registry.names())}")
    if args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    dtype_name = resolve_dtype(args.dtype, args.device)
    settings: dict[str, Any] = {"task": args.task, "ablations": base, "model": args.model, "dtype": dtype_name, "device": args.device, "seed": args.seed,
                                "max_new_tokens": args.max_new_tokens, "chat": args.chat, "registry": args.registry}
    for task in tasks:
        settings[task] = _task_settings(args, task)
    if args.tp != 1:  # heads sharded over ranks: routing under a budget may differ from one process, so a run of its own
        settings["tp"] = args.tp
        if "fidelity" in tasks:
            raise EvalError(f"--tp {args.tp}: the fidelity task measures attention outputs inside one process's cache, and under "
                            "tensor parallelism each rank holds only its share of the heads; run fidelity without --tp "
                            "(or leave it out of --tasks)")
    check_settings(settings, tasks)  # everything checkable without the model, before the folder is touched
    check_device(args.device)
    label = args.task if base is None else f"{args.task}-ablations-{base}"
    out = Path(args.out) if args.out else Path("results") / "eval" / f"{label}-{_model_slug(args.model)}-{args.device.replace(':', '')}"
    command = command_line(getattr(args, "argv", None))
    try:
        RunFolder.check(out, settings, fresh=args.fresh)  # a folder of other settings is refused before the model loads
    except EvalError as exc:
        if args.dtype == "auto" and re.search(r"(^|[(; ])dtype: ", str(exc)):
            raise EvalError(f"{exc}. --dtype auto (the default) is {dtype_name} on {args.device}; to resume a run of "
                            "another dtype pass its --dtype") from exc
        raise
    from kvweave.tools.distributed import TensorParallel

    tp = TensorParallel.start(args.tp, args.device)
    try:
        return _evaluate(args, tp, registry, names, tasks, settings, out, command, dtype_name, base)
    finally:
        tp.finish()


def _evaluate(args: argparse.Namespace, tp: Any, registry: Registry, names: list[str], tasks: list[str], settings: dict[str, Any],
              out: Path, command: str, dtype_name: str, base: str | None) -> int:
    """Load the model (its heads sharded over the ranks of ``tp``), run the tasks, print the results (rank 0)."""
    from kvweave.tools.eval_checks import check_model_context
    from kvweave.tools.models import context_limit, emulate_bf16_gemm

    torch.manual_seed(args.seed)
    model, tokenizer = tp.load_model(args.model, device=args.device, dtype=getattr(torch, dtype_name), progress=True)
    model._kvweave_label = _model_label_for(args.model)
    check_model_context(settings, tasks, context_limit(model))  # lengths against the model's context, still before writing
    if tp.main:
        run = RunFolder(out, settings, names, command, args.device, fresh=args.fresh)
    folder = tp.results_folder(out)  # the other ranks resume the same cells from a private copy of rank 0's folder
    if not tp.main:
        run = RunFolder(folder, settings, names, command, args.device)
    done = len(run.cells)
    print(f"kvweave eval {args.task}: {len(names)} pipelines -> {out}" + (f" (resuming: {done} cells done)" if done else ""), file=sys.stderr)
    if model.dtype == torch.bfloat16 and args.device == "cpu" and tp.size == 1:
        emulate_bf16_gemm(model)  # same products, fp32 accumulation as a bf16 GEMM: ~50x faster on AVX2 CPUs
    ev = Evaluation(model, tokenizer, registry, names, run, seed=args.seed, max_new_tokens=args.max_new_tokens, chat=args.chat,
                    progress=tp.main)
    try:
        results = run_tasks(ev, args, tasks)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(run.cells)} cells are saved in {out}; run the same command to resume", file=sys.stderr)
        return 130
    if not tp.main:
        return 0
    if args.task == "table":
        markdown = _table(run, names, ev.errors, results, base, model_label(model))  # writes table.md/csv/json and the plot
    else:
        markdown = task_summary(names, ev.errors, results, base, dtype_name)
    if args.json:
        print_json(_json_safe({"task": args.task, "model": args.model, "dtype": dtype_name, "device": args.device,
                               "pipelines": names, "folder": str(out), "errors": dict(ev.errors), "results": results}))
        print(f"results in {out}", file=sys.stderr)
    else:
        print(markdown.rstrip("\n"))
        print(f"\nresults in {out}")
    return 0


def task_summary(pipelines: list[str], errors: dict[str, str], results: dict[str, dict[str, Any]], base: str | None = None,
                 dtype: str | None = None) -> str:
    """The per-pipeline results of one task as a Markdown table (the columns ``eval table`` gives that task),
    with the needle protocol under a needle table."""
    rows = table_rows(pipelines, errors, results, dtype)
    markdown, _ = render_table(rows, results.get("qa", {}).get("datasets", []), base)
    note = ratio_note(rows) + needle_note(results.get("needle"))
    return markdown + ("\n" + note if note else "")


def _json_safe(data: Any) -> Any:
    """``data`` with NaN and infinities as null (JSON has neither), tuples as lists."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {str(k): _json_safe(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [_json_safe(v) for v in data]
    return data


def report(path: Path, ablations: str | None = None) -> dict[str, dict[str, Any]]:
    """Rebuild every output of a results folder from its cells (no model needed): the task JSON files,
    the plots and, for a ``table`` run, the table. Pipelines or cells that never finished show as not run."""
    run = RunFolder.existing(path)
    settings = run.settings
    pipelines = list(run.record.get("pipelines", []))
    label = _model_label_for(settings["model"])
    results: dict[str, dict[str, Any]] = {}
    for task in TASKS:
        opts = settings.get(task)
        if opts is None:
            continue
        if task == "needle":
            results[task] = needle_result(run, pipelines, {}, label, opts["lengths"], opts["depths"], opts["needles"],
                                          opts.get("protocol", QUERY_AWARE), opts.get("keys", 1))  # older runs: one prefill, one key
        elif task == "qa":
            results[task] = qa_result(run, pipelines, {}, opts["datasets"], opts["qa_samples"], opts["qa_length"])
        elif task == "ppl":
            results[task] = ppl_result(run, pipelines, {}, opts["tokens"], opts["chunk"], opts.get("prefill", 0))
        elif task == "fidelity":
            results[task] = fidelity_result(run, pipelines, {}, label, opts["tokens"], opts["chunk"], opts["probe"])
        else:
            results[task] = speed_result(run, pipelines, {}, opts["speed_tokens"], opts["speed_new_tokens"])
    if settings["task"] == "table":
        print(_table(run, pipelines, {}, results, ablations or settings.get("ablations"), label))
    return results


def _table(run: RunFolder, pipelines: list[str], errors: dict[str, str], results: dict[str, dict[str, Any]],
           base: str | None, label: str) -> str:
    """:func:`write_table`, with the needle protocol (and what of ``full``'s finds each pipeline found)
    added under the table in ``table.md`` and in the Markdown returned."""
    markdown = write_table(run, pipelines, errors, results, base, label)
    note = needle_note(results.get("needle"))
    if note:
        with (run.path / "table.md").open("a", encoding="utf-8") as file:
            file.write(note)
        markdown += "\n" + note
    return markdown


def cmd_report(args: argparse.Namespace) -> int:
    report(Path(args.folder), args.ablations)
    print(f"outputs rebuilt in {args.folder}", file=sys.stderr)
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    out, differed = merge(Path(args.out), [Path(folder) for folder in args.folders], args.prefer)
    for key in differed:
        print(f"kvweave eval merge: cell {key} differs between folders; kept the {args.prefer} folder's", file=sys.stderr)
    report(out)
    print(f"{len(args.folders)} folders merged into {out}", file=sys.stderr)
    return 0


def run_tasks(ev: Evaluation, args: argparse.Namespace, tasks: list[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for task in TASKS:
        if task not in tasks:
            continue
        if task == "needle":
            results[task] = run_needle(ev, args.lengths, args.depths, args.needles,
                                       QUERY_AWARE if args.query_aware else QUERY_AGNOSTIC, args.keys)
        elif task == "qa":
            results[task] = run_qa(ev, args.datasets, args.qa_samples, args.qa_length)
        elif task == "ppl":
            results[task] = run_ppl(ev, args.tokens, args.chunk, args.prefill)
        elif task == "fidelity":
            results[task] = run_fidelity(ev, args.tokens, args.chunk, args.probe)
        else:
            results[task] = run_speed(ev, args.speed_tokens, args.speed_new_tokens, args.speed_cuda_graphs)
        summary = ", ".join(f"{n}: {_summary(task, r)}" for n, r in results[task]["pipelines"].items())
        ev.say(f"{task}: {summary}")
    return results


def _summary(task: str, result: dict[str, Any]) -> str:
    if "accuracy" in result:
        return f"{result['accuracy']:.2f}"
    if "ppl" in result:
        return f"{result['ppl']:.2f}"
    if isinstance(result.get("error"), float):
        return f"{result['error']:.3f}"
    if "ttft_seconds" in result:
        return f"TTFT {result['ttft_seconds']:.2f} s, {result['decode_tokens_per_second']:.1f} tok/s"
    if "error" in result:
        return "error"
    return "/".join(f"{v['f1']:.2f}" for v in result.values() if isinstance(v, dict) and "f1" in v)
