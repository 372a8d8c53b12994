"""The ``kvweave`` command line: plugins, components, pipelines, resolve, generate.

Every error kvweave raises on purpose is printed as one paragraph on stderr with exit code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from kvweave.core import plugins
from kvweave.core.errors import KvweaveError
from kvweave.core.params import describe_fields
from kvweave.core.registry import load_registry


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2, default=str))


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(header, widths)).rstrip()]
    lines.append("  ".join("-" * width for width in widths))
    lines += ["  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    return "\n".join(lines)


def cmd_plugins(args: argparse.Namespace) -> int:
    catalog = plugins.catalog()
    data = {
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": list(p.hooks)}
            for p in catalog.plugins
        ],
        "failures": [{"name": f.name, "distribution": f.distribution, "error": f.error} for f in catalog.failures],
    }
    if args.json:
        _print_json(data)
        return 0
    rows = [[p["name"], p["distribution"], p["version"], ", ".join(p["hooks"])] for p in data["plugins"]]
    print(_table(rows, ["plugin", "distribution", "version", "hooks"]))
    for failure in data["failures"]:
        print(f"\nFAILED {failure['name']} ({failure['distribution']}): {failure['error']}")
    return 0


def cmd_components(args: argparse.Namespace) -> int:
    catalog = plugins.catalog()
    if args.group and args.group not in catalog.components:
        raise KvweaveError(f"unknown group '{args.group}'; groups are: {', '.join(catalog.components)}")
    items = [
        {
            "group": info.group,
            "name": info.name,
            "plugin": info.plugin,
            "distribution": info.distribution,
            "summary": (info.factory.__doc__ or "").strip().splitlines()[0] if info.factory.__doc__ else "",
            "parameters": describe_fields(info.factory),
        }
        for info in catalog.iter_components(args.group)
    ]
    if args.json:
        _print_json(items)
        return 0
    for item in items:
        print(f"{item['group']}/{item['name']}  (plugin {item['plugin']}, {item['distribution']})")
        if item["summary"]:
            print(f"    {item['summary']}")
        for param in item["parameters"]:
            default = "required" if param["required"] else f"default {param['default']!r}"
            doc = f"  {param['doc']}" if param["doc"] else ""
            print(f"    {param['name']}: {param['type']} ({default}){doc}")
    return 0


def cmd_pipelines(args: argparse.Namespace) -> int:
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
    pipeline = load_registry(args.registry).resolve(args.name)
    data = pipeline.to_dict()
    if args.json:
        _print_json(data)
        return 0
    print(f"{data['name']}: {data['description']}")
    print(f"  from {data['source']}; inheritance: {' -> '.join(data['extends_chain'])}")
    print("  settings: " + ", ".join(f"{k}={v}" for k, v in data["settings"].items()))
    for slot, cfg in data["slots"].items():
        params = ", ".join(f"{k}={v!r}" for k, v in cfg["params"].items())
        print(f"  {slot:<19} {cfg['use']}" + (f"  ({params})" if params else "") + f"  [{cfg['plugin']}]")
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from kvweave.engine.generation import generate
    from kvweave.tools.models import load_model
    from kvweave.engine.pipeline import build_cache

    if args.max_new_tokens < 1:
        raise KvweaveError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.prompt_file is not None:
        path = Path(args.prompt_file)
        if not path.is_file():
            raise KvweaveError(f"--prompt-file {path} does not exist")
        prompt = path.read_text(encoding="utf-8")
    else:
        prompt = args.prompt
    pipeline = load_registry(args.registry).resolve(args.pipeline)  # fail before loading any model
    import torch

    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype)
    cache = build_cache(pipeline, model, tokenizer=tokenizer)
    if args.chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt", add_special_tokens=not args.chat).to(model.device)
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
    print(f"ratio                {stats.ratio:.2f}x")
    print(f"prefill              {stats.prefill_seconds:.2f} s")
    print(f"decode               {stats.decode_tokens_per_second:.1f} tokens/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvweave", description="Compress the KV cache of transformer models with assembled pipelines.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help="installed plugins and the hooks each implements")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("components", help="registered components and their parameters")
    p.add_argument("--group", help="bases, routers, quantizers, probes or kernels")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_components)

    p = sub.add_parser("pipelines", help="the pipelines a registry defines")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_pipelines)

    p = sub.add_parser("resolve", help="one pipeline with inheritance applied and parameters validated")
    p.add_argument("name")
    p.add_argument("--registry")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_resolve)

    p = sub.add_parser("generate", help="generate text with a compressed cache and report its bytes")
    p.add_argument("--pipeline", required=True)
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt")
    prompt.add_argument("--prompt-file")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="compute dtype; auto is float32 on cpu, bfloat16 on cuda (the exact window is stored in it)",
    )
    p.add_argument("--registry")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap the prompt in the chat template")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_generate)

    from kvweave.tools.evaluate import add_eval_command
    from kvweave.tools.training import add_train_command

    add_train_command(sub)
    add_eval_command(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except KvweaveError as exc:
        print(f"kvweave: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
