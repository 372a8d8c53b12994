"""The command line of ``kvweave eval`` (its subcommands and options); what they run is
:mod:`kvweave.tools.evaluate`."""

from __future__ import annotations

import argparse
from typing import Any

from kvweave.tools.distributed import add_tp_option
from kvweave.tools.evaluate import DTYPES, TASKS, cmd_eval, cmd_merge, cmd_report, split_names


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc



def _add_common(p: argparse.ArgumentParser, table: bool) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--pipelines", help="comma-separated pipeline names")
    which.add_argument("--ablations", metavar="BASE", help="full, BASE and every pipeline that extends BASE (the Table-2 equivalent)")
    if table:
        p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype; auto is float32 on cpu, bfloat16 on cuda, as in generate (the exact window is "
                        "stored in it, so float32 lowers the reduction against 16 bits; bfloat16 on a CPU runs its GEMMs in fp32)")
    p.add_argument("--seed", type=int, default=0, help="seeds needles, QA sampling and every component's randomness")
    p.add_argument("--max-new-tokens", type=int, default=24, help="answer length for needle and QA")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap prompts in the chat template")
    p.add_argument("--out", help="results folder (default results/eval/<task>-<model>-<device>); rerun to resume")
    p.add_argument("--fresh", action="store_true", help="discard what the results folder holds and start over")
    p.add_argument("--json", action="store_true",
                   help="print the results as one JSON object on stdout at the end (instead of the table; progress stays on stderr)")
    add_tp_option(p)


def _add_task_options(p: argparse.ArgumentParser, task: str) -> None:
    if task == "needle":
        p.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8000], help="context lengths in tokens")
        p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in 0..1")
        p.add_argument("--needles", type=int, default=3, help="distinct needles per (length, depth) cell (the seed's needles in a fixed order: "
                       "rerunning into a folder with more keeps those it holds and runs the new ones)")
        p.add_argument("--keys", type=int, default=1,
                       help="facts hidden in each haystack (different keys and values, spread over depths); one is asked")
        p.add_argument("--query-aware", action="store_true",
                       help="prefill context and question together (the question seen before compression); default: "
                            "query-agnostic, the context prefilled and compressed before the question is read")
    elif task == "qa":
        p.add_argument("--datasets", type=split_names, default=["hotpotqa", "squad"], help="hotpotqa, squad")
        p.add_argument("--qa-samples", type=int, default=25, help="questions per dataset")
        p.add_argument("--qa-length", type=int, default=4096, help="context length in tokens (prompt included)")
    elif task in ("ppl", "fidelity"):
        if not any(a.dest == "tokens" for a in p._actions):
            p.add_argument("--tokens", type=int, default=4096, help="essay tokens fed to the cache")
            p.add_argument("--chunk", type=int, default=64, help="tokens per forward while feeding")
        if task == "ppl":
            p.add_argument("--prefill", type=int, default=0,
                           help="feed the first N tokens as one forward (a context; scored first for evictors by context importance) "
                                "and count perplexity on the tokens after them only")
        if task == "fidelity":
            p.add_argument("--probe", type=int, default=32, help="query positions Eq. (3) is measured for")
    else:
        p.add_argument("--speed-tokens", type=int, default=4096, help="prompt tokens for time to first token and decode speed")
        p.add_argument("--speed-new-tokens", type=int, default=64, help="tokens generated for the decode speed")
        p.add_argument("--speed-cuda-graphs", action="store_true",
                       help="decode each block of steps from a CUDA graph where the pipeline allows it (kernel 'lowbit' or 'fused'; on a "
                            "CPU the same steps without capture); the others decode as without, the table says which")


def add_eval_command(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="needle, QA, perplexity, fidelity and speed of pipelines; tables and plots")
    tasks = parser.add_subparsers(dest="task", required=True)
    helps = {
        "needle": "needle in a haystack over lengths x depths; heatmap per pipeline",
        "qa": "extractive QA (HotpotQA, SQuAD) over long distractor contexts; EM and F1",
        "ppl": "perplexity of essay text with the cache compressing as it fills, against a DynamicCache",
        "fidelity": "Eq. (3) attention-output relative error per layer and overall",
        "speed": "time to first token, decode tokens/s and stored bytes of one generation",
        "table": "several tasks for several pipelines: Markdown table, CSV, quality-vs-memory plot",
    }
    for task, text in helps.items():
        p = tasks.add_parser(task, help=text, description=text)
        _add_common(p, table=task == "table")
        for option_task in (TASKS if task == "table" else (task,)):
            _add_task_options(p, option_task)
        p.set_defaults(func=cmd_eval)
    p = tasks.add_parser("report", help="rebuild the JSON files, plots and table of a results folder from its cells",
                         description="Rebuild the outputs of a results folder (also a partial one) from cells.jsonl; no model is loaded.")
    p.add_argument("folder", help="a results folder written by kvweave eval")
    p.add_argument("--ablations", metavar="BASE", help="show the table's deltas against BASE (default: the run's own --ablations)")
    p.set_defaults(func=cmd_report)
    p = tasks.add_parser("merge", help="join needle runs split by length, depth or needles into one results folder",
                         description="Join needle results folders of the same settings, split by --lengths, --depths or --needles (for "
                                     "instance run as several processes), into a new folder, and build its outputs; no model is loaded.")
    p.add_argument("out", help="the new results folder (must not exist, or be empty)")
    p.add_argument("folders", nargs="+", help="results folders written by kvweave eval needle")
    p.add_argument("--prefer", choices=("first", "last"),
                   help="a cell in two folders with different results: keep the first (or last) folder's (default: refuse)")
    p.set_defaults(func=cmd_merge)
    return parser
