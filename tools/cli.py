"""The ``kvweave`` command line: plugins, components, pipelines, resolve, generate (and train, eval).

Every error kvweave raises on purpose is printed as one paragraph on stderr with exit code 2; Ctrl-C
prints one line and exits with 130. Nothing heavy is imported before a command needs it: ``--help``
imports neither torch nor transformers, and ``train``/``eval`` (whose modules import torch) are only
imported when they are the command given.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from kvweave.core.allocator import prefer_expandable_segments
from kvweave.core.errors import KvweaveError
from kvweave.tools.cli_generate import BREAKDOWN_TERMS, cmd_generate  # noqa: F401  (BREAKDOWN_TERMS: public)
from kvweave.tools.cli_io import print_json, read_text_file
from kvweave.tools.distributed import add_tp_option, silence_other_ranks

#: commands whose module imports torch: imported only when given; their help line for ``kvweave --help``
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("kvweave.tools.training", "add_train_command", "fit a trainable router's weights and gates on unlabeled text"),
    "train-scorer": ("kvweave.tools.scorer_fit", "add_train_scorer_command", "fit the kvzip evictor's one-forward surrogate scorer to KVzip's scores"),
    "eval": ("kvweave.tools.eval_args", "add_eval_command", "needle, QA, perplexity, fidelity and speed of pipelines; tables and plots"),
}
INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C (128 + SIGINT)
#: ``kvweave generate`` shows a progress bar on stderr while a prompt of at least this many tokens is prefilled
PROGRESS_TOKENS = 1000


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    from kvweave.core import plugins

    catalog = plugins.catalog()
    data = {
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": list(p.hooks)}
            for p in catalog.plugins
        ],
        "disabled": [{"name": p.name, "distribution": p.distribution, "version": p.version} for p in catalog.disabled],
        "failures": [{"name": f.name, "distribution": f.distribution, "error": f.error} for f in catalog.failures],
        "conflicts": [
            {"group": c.group, "name": c.name, "plugins": [{"plugin": i.plugin, "distribution": i.distribution} for i in c.claims],
             "error": c.describe()}
            for c in catalog.conflicts
        ],
    }
    if args.json:
        print_json(data)
        return 0
    rows = [[p["name"], p["distribution"], p["version"], ", ".join(p["hooks"])] for p in data["plugins"]]
    rows += [[p["name"], p["distribution"], p["version"], f"DISABLED ({plugins.DISABLE_ENV})"] for p in data["disabled"]]
    print(_table(sorted(rows), ["plugin", "distribution", "version", "hooks"]))
    for failure in data["failures"]:
        print(f"\nFAILED {failure['name']} ({failure['distribution']}): {failure['error']}")
    for conflict in data["conflicts"]:
        print(f"\nCONFLICT {conflict['group']}/{conflict['name']}: {conflict['error']}")
    return 0


def cmd_components(args: argparse.Namespace) -> int:
    from kvweave.core import plugins
    from kvweave.core.params import describe_fields

    catalog = plugins.catalog()
    if args.group and args.group not in catalog.components:
        raise KvweaveError(f"unknown group '{args.group}'; groups are: {', '.join(catalog.components)}")
    items = []
    for first in catalog.iter_components(args.group):
        conflict = catalog.conflict(first.group, first.name)
        for info in conflict.claims if conflict else (first,):
            item = {
                "group": info.group,
                "name": info.name,
                "plugin": info.plugin,
                "distribution": info.distribution,
                "summary": (info.factory.__doc__ or "").strip().splitlines()[0] if info.factory.__doc__ else "",
                "parameters": describe_fields(info.factory),
            }
            if conflict:
                item["conflict"] = conflict.describe()
            items.append(item)
    if args.json:
        print_json(items)
        return 0
    for item in items:
        print(f"{item['group']}/{item['name']}  (plugin {item['plugin']}, {item['distribution']})")
        if item.get("conflict"):
            print(f"    AMBIGUOUS: {item['conflict']}")
        if item["summary"]:
            print(f"    {item['summary']}")
        for param in item["parameters"]:
            default = "required" if param["required"] else f"default {param['default']!r}"
            doc = f"  {param['doc']}" if param["doc"] else ""
            print(f"    {param['name']}: {param['type']} ({default}){doc}")
    return 0


def cmd_pipelines(args: argparse.Namespace) -> int:
    from kvweave.core.registry import load_registry

    registry = load_registry(args.registry)
    items = [
        {"name": name, "extends": table.get("extends"), "description": table.get("description", ""), "source": registry.sources[name]}
        for name, table in registry.tables.items()
    ]
    if args.json:
        print_json(items)
        return 0
    print(_table([[i["name"], i["extends"] or "-", i["description"]] for i in items], ["pipeline", "extends", "description"]))
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    from kvweave.core.registry import load_registry

    pipeline = load_registry(args.registry).resolve(args.name)
    data = pipeline.to_dict()
    if args.json:
        print_json(data)
        return 0
    print(f"{data['name']}: {data['description']}")
    print(f"  from {data['source']}; inheritance: {' -> '.join(data['extends_chain'])}")
    print("  settings: " + ", ".join(f"{k}={v}" for k, v in data["settings"].items()))
    slots = data["slots"]
    for slot, cfg in slots.items():
        params = ", ".join(f"{k}={v!r}" for k, v in cfg["params"].items())
        unused = f"keys.{slot}" in slots and f"values.{slot}" in slots  # both kinds take their own
        print(f"  {slot:<19} {cfg['use']}" + (f"  ({params})" if params else "") + f"  [{cfg['plugin']}]"
              + ("  (unused: keys and values have their own)" if unused else ""))
    return 0


def cmd_generate_with_progress(args: argparse.Namespace) -> int:
    """``kvweave generate``; a prompt of :data:`PROGRESS_TOKENS` tokens or more shows a bar on stderr while it
    is prefilled, one step per decoder layer of the single prefill forward (the prompt is not split, so the
    tokens are those of a run without the bar, for every pipeline)."""
    from kvweave.engine.generation import show_prefill_progress

    with show_prefill_progress(PROGRESS_TOKENS):
        return cmd_generate(args)


def check_registry_option(path: str | None) -> None:
    """``--registry FILE``: refused before any command reads it when it is missing, a folder, unreadable,
    or not UTF-8 (TOML files are UTF-8)."""
    if path is None:
        return
    folder = Path(path)
    if folder.is_dir():
        tomls = sorted(p.name for p in folder.glob("*.toml"))
        inside = f"; it holds {', '.join(tomls[:5])}" if tomls else "; it holds no .toml file"
        raise KvweaveError(f"--registry {folder} is a folder, not a registry file: pass the path of a .toml file{inside}")
    if not folder.exists():
        raise KvweaveError(f"registry file {folder} does not exist (resolved to {folder.absolute()}); --registry takes a .toml file")
    read_text_file(folder, "registry file")


class HelpFormatter(argparse.HelpFormatter):
    """Help that shows each option's default, as the command line spells it (lists comma-separated);
    not for flags, options without a default, or help that already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = (action.help or "").strip()
        shown = _default_text(action)
        if shown is None or "%(default)" in help_text or re.search(r"\bdefault[: ]", help_text):
            return help_text
        return (help_text + " " if help_text else "") + f"(default: {shown})".replace("%", "%%")

    def _format_action(self, action: argparse.Action) -> str:
        shown = _default_text(action)
        if not (action.help or "").strip() and shown is not None:  # argparse prints no help line without a help text
            action = copy.copy(action)
            action.help = f"(default: {shown})".replace("%", "%%")
        return super()._format_action(action)


def _default_text(action: argparse.Action) -> str | None:
    default = action.default
    if default is None or isinstance(default, bool) or default is argparse.SUPPRESS or not action.option_strings:
        return None
    if isinstance(default, (list, tuple)):
        return ",".join(str(item) for item in default)
    return str(default)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose help shows defaults; every subcommand's parser is one too (argparse
    makes subparsers of the parent's class), those of ``train`` and ``eval`` included."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand ``argv`` names (its first argument that is not an option), if any."""
    return next((arg for arg in argv if not arg.startswith("-")), None)


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The ``kvweave`` parser. ``train`` and ``eval`` get their real parsers (importing their modules,
    and torch) when ``command`` is theirs or None (every parser); otherwise a placeholder with the same
    help line (``main`` passes the command its arguments name, "" for none)."""
    parser = Parser(prog="kvweave", description="Compress the KV cache of transformer models with assembled pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="installed plugins and the hooks each implements")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("components", help="registered components and their parameters")
    p.add_argument("--group", help="bases, routers, quantizers, probes, kernels or evictors")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_components)

    p = sub.add_parser("pipelines", help="the pipelines a registry defines")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pipelines)

    p = sub.add_parser("resolve", help="one pipeline with inheritance applied and parameters validated")
    p.add_argument("name")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser(
        "generate", help="generate text with a compressed cache and report its bytes",
        description="Generate text with a compressed cache and report its bytes. A prompt of "
                    f"{PROGRESS_TOKENS:,} tokens or more shows a progress bar on stderr while it is prefilled.",
    )
    p.add_argument("--pipeline", required=True)
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-file", help="a UTF-8 text file holding the prompt")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto is float32 on cpu, bfloat16 on cuda (the exact window is stored in it)",
    )
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap the prompt in the chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7, help="with --sample: > 0")
    p.add_argument("--top-p", type=float, default=0.9, help="with --sample: in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action="store_true",
                   help="greedy decoding with each block's steps replayed from a CUDA graph (--device cuda; pipelines "
                        "read by the lowbit kernel): the same tokens, far less host time a step")
    p.add_argument("--json", action="store_true")
    add_tp_option(p)
    p.set_defaults(func=cmd_generate_with_progress)

    for name, (module, function, help_text) in LAZY_COMMANDS.items():
        if command is None or command == name:
            getattr(importlib.import_module(module), function)(sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def _one_paragraph(message: str) -> str:
    return re.sub(r"\s*\n\s*", " ", message.strip())


def _show_warning(message: Any, category: type[Warning], filename: str, lineno: int, file: Any = None, line: str | None = None) -> None:
    """kvweave's own warnings as one line ``kvweave: warning: ...``; others as Python prints them."""
    if _is_kvweave_file(filename):
        print(f"kvweave: warning: {_one_paragraph(str(message))}", file=sys.stderr if file is None else file)
    else:
        _python_show_warning(message, category, filename, lineno, file, line)


def _is_kvweave_file(filename: str) -> bool:
    root = Path(__file__).resolve().parents[1]  # the folder holding core/, tools/, ... (checkout or installed package)
    try:
        Path(filename).resolve().relative_to(root)
    except (ValueError, OSError):
        return False
    return True


_python_show_warning = warnings.showwarning


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    prefer_expandable_segments()  # before any command starts CUDA (kvweave.core.allocator)
    silence_other_ranks(argv)  # under torchrun with --tp N only rank 0 prints
    previous = warnings.showwarning
    warnings.showwarning = _show_warning
    try:
        try:
            args = build_parser(command_of(argv) or "").parse_args(argv)
            args.argv = argv
            check_registry_option(getattr(args, "registry", None))
            return args.func(args)
        except KvweaveError as exc:
            print(f"kvweave: error: {_one_paragraph(str(exc))}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\nkvweave: interrupted", file=sys.stderr)
            return INTERRUPTED
    finally:
        warnings.showwarning = previous


if __name__ == "__main__":
    sys.exit(main())
