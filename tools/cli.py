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
import json
import math
import re
import sys
import warnings
from pathlib import Path
from typing import Any, Sequence

from kvweave.core.errors import KvweaveError

#: commands whose module imports torch: imported only when given; their help line for ``kvweave --help``
LAZY_COMMANDS: dict[str, tuple[str, str, str]] = {
    "train": ("kvweave.tools.training", "add_train_command", "fit a trainable router's weights and gates on unlabeled text"),
    "eval": ("kvweave.tools.evaluate", "add_eval_command", "needle, QA, perplexity, fidelity and speed of pipelines; tables and plots"),
}
INTERRUPTED = 130  # the shell's code for a process stopped by Ctrl-C (128 + SIGINT)


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


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
        _print_json(data)
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
        _print_json(items)
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
        _print_json(items)
        return 0
    print(_table([[i["name"], i["extends"] or "-", i["description"]] for i in items], ["pipeline", "extends", "description"]))
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    from kvweave.core.registry import load_registry

    pipeline = load_registry(args.registry).resolve(args.name)
    data = pipeline.to_dict()
    if args.json:
        _print_json(data)
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


def read_text_file(path: str | Path, what: str) -> str:
    """The UTF-8 text of the file ``what`` names (an option, e.g. ``--prompt-file``), or a
    :class:`KvweaveError` saying whether it is missing, a folder, unreadable or not UTF-8."""
    path = Path(path)
    if path.is_dir():
        raise KvweaveError(f"{what} {path} is a folder, not a file; pass the path of a file inside it")
    if not path.exists():
        raise KvweaveError(f"{what} {path} does not exist (resolved to {path.absolute()})")
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise KvweaveError(f"{what} {path} cannot be read: {exc.strerror or exc}") from exc
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise KvweaveError(
            f"{what} {path} is not UTF-8 text: byte 0x{data[exc.start]:02x} at offset {exc.start} (line {line}) "
            "cannot be decoded; save the file as UTF-8"
        ) from exc


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
    from kvweave.core.registry import load_registry

    pipeline = load_registry(args.registry).resolve(args.pipeline)  # fail before loading any model
    import torch

    from kvweave.engine.generation import generate
    from kvweave.engine.pipeline import build_cache
    from kvweave.tools.models import context_limit, load_model

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    cache = build_cache(pipeline, model, tokenizer=tokenizer)
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
    new_tokens, stats = generate(model, inputs, cache, **options)
    completion = tokenizer.decode(new_tokens[0], skip_special_tokens=True)
    if args.json:
        _print_json({"model": args.model, "text": completion, "stats": stats.to_dict()})
        return 0
    print(completion.strip())
    print()
    print(f"--- kvweave: pipeline {stats.pipeline}, model {args.model}, device {args.device}")
    print(f"prompt tokens        {stats.prompt_tokens}")
    print(f"generated tokens     {stats.generated_tokens}")
    print(f"stored KV bytes      {stats.stored_bytes:,}  ({', '.join(f'{k} {v:,}' for k, v in stats.breakdown.items() if v)})")
    print(f"16-bit full cache    {stats.full_16bit_bytes:,}  ({stats.cached_tokens} tokens)")
    ratio = f"{stats.ratio:.2f}x vs a 16-bit cache"
    if stats.model_dtype not in ("bfloat16", "float16"):
        ratio += f", {stats.ratio_model_dtype:.2f}x vs this model's {stats.model_dtype} cache"
    print(f"ratio                {ratio}")
    print(f"prefill              {stats.prefill_seconds:.2f} s")
    print(f"decode               {stats.decode_tokens_per_second:.1f} tokens/s")
    for part, value in stats.breakdown.items():
        if value and part in BREAKDOWN_TERMS:
            print(f"  {part:18s} {BREAKDOWN_TERMS[part]}")
    return 0


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

    p = sub.add_parser("generate", help="generate text with a compressed cache and report its bytes")
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
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

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


#: what each part of the stored bytes is (printed under the stats of `kvweave generate`)
BREAKDOWN_TERMS = {
    "exact_window": "the most recent tokens, kept as computed (in the model's dtype)",
    "coefficients": "the packed (quantized / projected) keys and values of the compressed tokens",
    "residuals": "routed corrections of chosen tokens, with their indices and scales",
    "basis_state": "shared bases the coefficients decode with",
    "observation": "recent queries and token flags kept for the router or probe",
    "eviction": "cache positions of the kept tokens (and accumulated attention, H2O)",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
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
