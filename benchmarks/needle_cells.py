"""Chosen cells of the needle grid, for a few pipelines: the cells `kvweave eval needle` builds (query-agnostic,
chat template where the model has one, needles of seed 0), each answered once, with the real bytes. For checking
what a change does to the cells a pipeline lost without running the whole grid.

    python benchmarks/needle_cells.py --pipelines A,B --cells 5000:0.1:8,5000:0.5:15 [--registry R] [--model M]
        [--device cpu] [--dtype bfloat16]

A cell is ``length:depth:needle`` (the needle's index among the 16 of seed 0, as in ``--needles 16``). Prints one
row per pipeline and cell: hit, the answer, bytes against a 16-bit cache.
"""

from __future__ import annotations

import argparse


def parse_cells(text: str) -> list[tuple[int, float, int]]:
    """``length:depth:needle`` items, comma-separated."""
    cells = []
    for item in text.split(","):
        parts = item.split(":")
        try:
            length, depth, needle = int(parts[0]), float(parts[1]), int(parts[2])
        except (ValueError, IndexError):
            raise SystemExit(f"--cells: {item!r} is not length:depth:needle (e.g. 5000:0.1:8)") from None
        if len(parts) != 3 or not 0.0 <= depth <= 1.0 or not 0 <= needle < 16:
            raise SystemExit(f"--cells: {item!r}: depth must be in 0..1 and needle in 0..15")
        cells.append((length, depth, needle))
    return cells


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", required=True)
    parser.add_argument("--cells", required=True, help="length:depth:needle, comma-separated")
    parser.add_argument("--registry", default=None)
    parser.add_argument("--model", default="default")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    cells = parse_cells(args.cells)
    import torch

    from kvweave.core.registry import load_registry
    from kvweave.tools import datasets, scoring
    from kvweave.tools.data import essays_text
    from kvweave.tools.eval_context import Evaluation
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype), progress=False)
    names = args.pipelines.split(",")
    ev = Evaluation(model, tokenizer, load_registry(args.registry), names, None, progress=False)
    needles = datasets.make_needles(16, 0)
    text = essays_text()
    print("| pipeline | length | depth | needle | hit | answer | bytes x |\n|---|---:|---:|---:|---|---|---:|", flush=True)
    for name in names:
        if ev.pipeline(name) is None:
            print(f"| {name} | - | - | - | - | skipped: {ev.errors[name]} | - |")
            continue
        for length, depth, index in cells:
            cell = datasets.needle_cell(tokenizer, text, needles[index], index, length, depth, 0, 1)
            inputs, split = ev.encode_split(cell.context, cell.question)
            answer, stats = ev.answer(name, inputs, context_tokens=split)
            hit = scoring.needle_hit(answer, cell.needle.answer)
            print(f"| {name} | {length} | {depth} | {index} | {'yes' if hit else 'no'} | {answer.strip()!r} | "
                  f"{stats.full_16bit_bytes / stats.stored_bytes:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
