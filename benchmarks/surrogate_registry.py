"""A registry for timing the ``kvzip`` evictor's surrogate scorer on the benchmarks' random-weight models.

    python benchmarks/surrogate_registry.py --out DIR [--base benchmarks/dense_sweep.toml] [--pipelines kzd-k4v2-f48-d128]
                                           [--layers 32] [--smoke]

The benchmarks' models (``decode_e2e.py``: Llama-3-8B's shape, or ``--smoke``'s tiny one) have random weights, so no
surrogate fitted on a real model fits them, and a fit on them would time nothing more: the scorer's cost does not
depend on its values. This writes ``DIR/surrogate.pt`` (random weights of the model's shape, every layer scored) and
``DIR/registry.toml``: the ``--base`` registry followed by ``NAME-s`` for each of ``--pipelines``, the same pipeline
scored by that surrogate instead of KVzip's repetitions. Then, for example:

    python benchmarks/decode_e2e.py --registry DIR/registry.toml --methods full,kzd-k4v2-f48-d128,kzd-k4v2-f48-d128-s \\
        --ttft 32768 --batches ""
    python benchmarks/profile_prefill.py --registry DIR/registry.toml --pipeline kzd-k4v2-f48-d128-s --tokens 32768
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from kvweave.core.registry import load_registry
from kvweave.engine.surrogate import FORMAT

from decode_e2e import llama3_8b, smoke_config


def write(out: Path, base: Path, names: list[str], layers: int, smoke: bool) -> Path:
    config = smoke_config(layers) if smoke else llama3_8b(layers)
    registry = load_registry(base)
    for name in names:
        registry.resolve(name)  # an unknown name fails here, naming the registry's pipelines
    out.mkdir(parents=True, exist_ok=True)
    weights = out / "surrogate.pt"
    hidden, heads = config.hidden_size, config.num_key_value_heads
    generator = torch.Generator().manual_seed(0)
    torch.save({"format": FORMAT, "weight": torch.randn(layers, hidden, heads, generator=generator) * hidden ** -0.5,
                "bias": torch.zeros(layers, heads), "scored": torch.ones(layers, dtype=torch.bool), "hidden": hidden,
                "model": "random " + ("smoke" if smoke else "llama-3-8b-shaped")}, weights)
    text = base.read_text()
    for name in names:
        text += (f'\n\n[pipelines.{name}-s]\nextends = "{name}"\ndescription = "{name} scored by a random surrogate '
                 f'(timing only: one forward, no repetition)."\n\n[pipelines.{name}-s.evictor]\nscorer = "surrogate"\n'
                 f'weights = "{weights.resolve()}"\n')
    path = out / "registry.toml"
    path.write_text(text)
    load_registry(path).resolve(f"{names[0]}-s")  # the written registry reads back
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for surrogate.pt and registry.toml")
    parser.add_argument("--base", default="benchmarks/dense_sweep.toml", help="the registry the timed pipelines come from")
    parser.add_argument("--pipelines", default="kzd-k4v2-f48-d128", help="comma-separated pipelines whose evictor is kvzip")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="the shape of decode_e2e.py's --smoke model")
    args = parser.parse_args()
    path = write(Path(args.out), Path(args.base), [n for n in args.pipelines.split(",") if n], args.layers, args.smoke)
    print(f"wrote {path} (pipelines {', '.join(n + '-s' for n in args.pipelines.split(',') if n)})")


if __name__ == "__main__":
    main()
