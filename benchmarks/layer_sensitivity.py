"""How much each layer loses to low-bit keys or values, end to end, and a per-layer bit table for a budget.

Layer-wise mixed precision after KVTuner (Li et al., "KVTuner: Sensitivity-Aware Layer-wise Mixed Precision
KV Cache Quantization", arXiv:2502.04420): layers differ in how much a coarser cache hurts the output, so at
one average width the sensitive layers should get the wider codes. This script (written for kvweave, no
code taken from KVTuner) measures that sensitivity directly: for one layer at a time it replaces that
layer's keys (or values) by their quantized round trip and takes the mean, over all positions, of
KL(p_exact || p_perturbed) between the next-token distributions of an exact forward and the perturbed one.

Usage::

    python benchmarks/layer_sensitivity.py --kind values --low 2 --high 3 --mean 2.5
    python benchmarks/layer_sensitivity.py --kind keys --low 3 --high 4 --mean 3.5 --json /tmp/keys.json

Quantizers: values ``rotated-token`` (``bits`` 2, 3 or 4); keys ``channel-alloc`` (``mean_bits``, a multiple
of 1/8; group 64, no outliers). Each works per KV head on [B, H, T, D]. Where it acts:

* keys: the output of ``self_attn.k_proj``, i.e. before the rotary embedding, where kvweave's pre-RoPE
  pipelines quantize. A model whose attention has a ``k_norm`` (Qwen3, Gemma-3) normalises the keys after
  ``k_proj``; there the hook sits on ``k_norm``'s output instead, which is what the cache holds before
  RoPE. ``k_norm`` output may be [B, T, H, D] (Qwen3) or [B, H, T, D] (Gemma-3); the layout is told by
  which dim equals the number of KV heads (unambiguous since T is a multiple of 64).
* values: the output of ``self_attn.v_proj``, or of ``v_norm`` where the attention has one.

Allocation: every layer starts at ``--low``; the layers with the largest gains ``KL_low - KL_high`` move to
``--high``, round((mean - low) / (high - low) * L) of them. Last, the whole model is run with every layer
quantized: at the chosen table, at the same count of ``--high`` layers evenly spaced (a blind table of the
same mean), at ``--low`` and ``--high`` everywhere and, when ``--mean`` is a valid width, at ``--mean``
everywhere; a table that helps has the lower KL at its mean. The single-layer KLs add only approximately,
so that end-to-end check is the one to trust.
With ``--held N`` the layers are weighed by the tokens each holds after an N-token prompt (a full-attention layer
``N x --kept``, a sliding-window layer its window, or ``--window``): ``--mean`` is then the mean width over the
stored tokens, and layers move to ``--high`` in order of gain per token held while they fit, so on a model with
sliding-window layers (Gemma-3) the short layers widen first; the tables compared then add the KL-only table.
Text: the first ``--tokens`` tokens of the Paul Graham essays (``kvweave.tools.data``); or, with ``--text
needles``, ``--prompts`` needle prompts of about ``--tokens`` tokens (the cells ``kvweave eval needle`` builds, chat
template included, with needles drawn from ``--seed``, 1 by default, so not the evaluation grid's seed 0), each
followed by its needle's sentence as the answer, the KL taken only where the model predicts the answer's digits:
which layers' codes cost the retrieval, not the next word of an essay. Used for
``benchmarks/lean_sweep.toml``'s retrieval value table (docs/frontier.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the tables' module beside it, however this file is loaded
from layer_tables import allocate, allocate_by_bytes, compact, evenly, held_tokens, weighted_mean  # noqa: E402

KINDS = ("keys", "values")


def make_quantizer(kind: str, bits: float) -> Any:
    """The round-trip quantizer of ``kind`` at ``bits`` (raises ValueError/TypeError for a bad width)."""
    if kind == "values":
        from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

        if bits != int(bits):
            raise ValueError(f"rotated-token values take whole bits, got {bits}")
        return RotatedTokenQuantizer(bits=int(bits)).for_kind("values")
    from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer

    return ChannelAllocQuantizer(mean_bits=float(bits), group=64, outliers=0).for_kind("keys")


def valid_width(kind: str, bits: float, head_dim: int) -> bool:
    """Whether ``bits`` is a width the quantizer of ``kind`` accepts for heads of ``head_dim``."""
    try:
        make_quantizer(kind, bits).check_width(head_dim, "layer_sensitivity")
    except Exception:  # noqa: BLE001 - any refusal means "not a valid uniform width"
        return False
    return True


def shape_of(model: Any) -> tuple[int, int]:
    """(KV heads, head dim) of ``model``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_key_value_heads, head_dim


def decoder_layers(model: Any) -> list[Any]:
    from kvweave.engine.generation import decoder_layers as found

    layers = found(model)
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")
    return layers


def target_module(layer: Any, kind: str) -> torch.nn.Module:
    """The module whose output is what the cache stores for ``kind`` before RoPE."""
    attn = layer.self_attn
    norm, proj = ("k_norm", "k_proj") if kind == "keys" else ("v_norm", "v_proj")
    module = getattr(attn, norm, None)
    return module if isinstance(module, torch.nn.Module) else getattr(attn, proj)


def round_trip(x: torch.Tensor, quantizer: Any, heads: int, head_dim: int) -> torch.Tensor:
    """``x`` (a projection output [B, T, H*D], or a norm output [B, T, H, D] / [B, H, T, D]) with each KV
    head's [T, D] replaced by its quantized round trip; same shape and dtype. Where T is not a multiple of 64 the
    last T % 64 positions stay exact (a needle prompt's question and answer: the part a cache has not packed)."""
    axis = 2 if x.dim() == 4 and x.shape[1] == heads and x.shape[2] != heads else 1  # the token axis
    tail = x.shape[axis] % 64
    if tail:
        body = x.narrow(axis, 0, x.shape[axis] - tail)
        if body.shape[axis] == 0:
            return x
        return torch.cat((round_trip(body, quantizer, heads, head_dim), x.narrow(axis, x.shape[axis] - tail, tail)), axis)
    if x.dim() == 3:
        per_head = x.reshape(x.shape[0], x.shape[1], heads, head_dim).transpose(1, 2)
        restored = quantizer.dequantize(quantizer.quantize(per_head.float()), torch.float32)
        return restored.transpose(1, 2).reshape(x.shape).to(x.dtype)
    if x.dim() == 4 and x.shape[2] == heads and x.shape[1] != heads:  # [B, T, H, D]
        restored = quantizer.dequantize(quantizer.quantize(x.transpose(1, 2).float()), torch.float32)
        return restored.transpose(1, 2).to(x.dtype)
    if x.dim() == 4 and x.shape[1] == heads:  # [B, H, T, D]
        return quantizer.dequantize(quantizer.quantize(x.float()), torch.float32).to(x.dtype)
    raise ValueError(f"unexpected key/value shape {tuple(x.shape)} for {heads} KV heads of width {head_dim}")


@contextmanager
def perturbed(model: Any, kind: str, bits_by_layer: dict[int, float]) -> Iterator[None]:
    """Within the block, each layer in ``bits_by_layer`` has its ``kind`` quantized at those bits."""
    heads, head_dim = shape_of(model)
    layers = decoder_layers(model)
    handles = []
    for index, bits in bits_by_layer.items():
        quantizer = make_quantizer(kind, bits)

        def hook(_module: Any, _args: Any, output: torch.Tensor, quantizer: Any = quantizer) -> torch.Tensor:
            return round_trip(output, quantizer, heads, head_dim)

        handles.append(target_module(layers[index], kind).register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


class Sample(NamedTuple):
    """One sequence ``ids`` [1, T], the positions ``rows`` whose next-token distributions count (None: all), and the
    exact forward's float64 log-probabilities there ``exact`` [R or T, V]."""

    ids: torch.Tensor
    exact: torch.Tensor
    rows: torch.Tensor | None = None


def log_probs(model: Any, ids: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """float64 next-token log-probabilities [T, V] of one sequence ``ids`` [1, T] (an exact forward), or at
    ``rows`` only [R, V]."""
    with torch.inference_mode():
        logits = model(input_ids=ids, use_cache=False).logits[0]
        return torch.log_softmax((logits if rows is None else logits[rows]).double(), dim=-1)


def mean_kl(model: Any, ids: torch.Tensor, exact: torch.Tensor, kind: str, table: dict[int, float],
            rows: torch.Tensor | None = None) -> float:
    """Mean over positions (``rows``: those only) of KL(p_exact || p_quantized), the layers of ``table``
    quantized at its bits; ``exact`` as :func:`log_probs` gives it for the same ``rows``."""
    with torch.inference_mode(), perturbed(model, kind, table):
        logits = model(input_ids=ids, use_cache=False).logits[0]
    if rows is not None:
        logits = logits[rows]
    total = 0.0
    for start in range(0, logits.shape[0], 256):  # chunks keep the float64 copies small
        approx = torch.log_softmax(logits[start : start + 256].double(), dim=-1)
        part = exact[start : start + 256]
        total += float((part.exp() * (part - approx)).sum())
    return total / logits.shape[0]


def samples_kl(model: Any, samples: list[Sample], kind: str, table: dict[int, float]) -> float:
    """:func:`mean_kl` averaged over ``samples``."""
    return sum(mean_kl(model, s.ids, s.exact, kind, table, s.rows) for s in samples) / len(samples)


def as_samples(model: Any, ids: torch.Tensor | list[Sample], exact: torch.Tensor | None) -> list[Sample]:
    if isinstance(ids, list):
        return ids
    return [Sample(ids, log_probs(model, ids) if exact is None else exact)]


def kl_per_layer(
    model: Any, ids: torch.Tensor | list[Sample], kind: str, widths: list[float], exact: torch.Tensor | None = None,
    progress: bool = True,
) -> list[list[float]]:
    """``[layer][width]``: mean KL with only that layer's ``kind`` quantized at each of ``widths``, over one
    sequence ``ids`` (all its positions) or a list of :class:`Sample`."""
    samples = as_samples(model, ids, exact)
    layers = range(len(decoder_layers(model)))
    return [
        [samples_kl(model, samples, kind, {layer: bits}) for bits in widths]
        for layer in tqdm(layers, desc=f"{kind} per layer", disable=not progress)
    ]


def whole_model_kl(
    model: Any, ids: torch.Tensor | list[Sample], exact: torch.Tensor | None, kind: str, tables: dict[str, list[float]]
) -> dict[str, float]:
    """Mean KL with every layer quantized (hooks on all layers at once), per named table of bits."""
    samples = as_samples(model, ids, exact)
    return {name: samples_kl(model, samples, kind, dict(enumerate(table))) for name, table in tables.items()}


def needle_samples(model: Any, tokenizer: Any, count: int, length: int, seed: int) -> list[Sample]:
    """``count`` needle prompts of about ``length`` tokens (depths 0.1, 0.5, 0.9 in turn), each followed by its
    needle's sentence; rows: the positions that predict the tokens of the answer's digits."""
    from kvweave.core.registry import load_registry
    from kvweave.tools import datasets
    from kvweave.tools.data import essays_text
    from kvweave.tools.eval_context import Evaluation

    evaluation = Evaluation(model, tokenizer, load_registry(None), [], None, progress=False)
    text, samples = essays_text(), []
    for index, needle in enumerate(datasets.make_needles(count, seed)):
        cell = datasets.needle_cell(tokenizer, text, needle, index, length, (0.1, 0.5, 0.9)[index % 3], seed)
        inputs, _ = evaluation.encode_split(cell.context, cell.question)
        prompt = inputs["input_ids"][0].tolist()
        answer = tokenizer(needle.sentence, add_special_tokens=False)["input_ids"]
        pieces = [tokenizer.decode([t]) for t in answer]
        span = datasets.pieces_over(pieces, needle.sentence.find(needle.answer), len(needle.answer))
        digits = [len(prompt) + position - 1 for position in span]  # the rows that predict the answer's tokens
        if not digits:
            raise SystemExit(f"needle {index}: the answer {needle.answer!r} is not found in the tokens of {needle.sentence!r}")
        ids = torch.tensor([prompt + answer])
        rows = torch.tensor(digits)
        samples.append(Sample(ids, log_probs(model, ids, rows), rows))
    return samples


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="default", help="a kvweave model spec (default: %(default)s)")
    parser.add_argument("--tokens", type=int, default=1024, help="tokens of essay text, a multiple of 64")
    parser.add_argument("--kind", choices=KINDS, required=True)
    parser.add_argument("--low", type=float, help="narrow width (default 2 for values, 3 for keys)")
    parser.add_argument("--high", type=float, help="wide width (default 3 for values, 4 for keys)")
    parser.add_argument("--mean", type=float, required=True, help="target average bits over layers")
    parser.add_argument("--json", help="write the measurements and the table to this path")
    parser.add_argument("--text", choices=("essays", "needles"), default="essays",
                        help="essays: KL at every position of one text; needles: at the answer digits of needle prompts")
    parser.add_argument("--prompts", type=int, default=6, help="needle prompts (--text needles)")
    parser.add_argument("--seed", type=int, default=1, help="needle seed (--text needles; the evaluation grid uses 0)")
    parser.add_argument("--held", type=int, help="weigh each layer by the tokens it holds after a prompt of this many "
                        "tokens (full-attention layers: HELD x --kept, sliding-window ones: their window), so --mean is "
                        "the mean over stored tokens and cheap layers widen first")
    parser.add_argument("--kept", type=float, default=1.0, help="share of the context a full-attention layer keeps "
                        "(--held; e.g. 0.5 for a KVzip evictor keeping half)")
    parser.add_argument("--window", type=int, help="tokens a sliding-window layer keeps (--held; default: the model's "
                        "window; e.g. a pipeline's sliding_tokens)")
    args = parser.parse_args(argv)
    if args.held is not None and args.held < 1:
        parser.error(f"--held must be a positive number of tokens, got {args.held}")
    if not 0 < args.kept <= 1:
        parser.error(f"--kept must lie in (0, 1], got {args.kept:g}")
    if args.window is not None and args.window < 1:
        parser.error(f"--window must be a positive number of tokens, got {args.window}")
    if args.prompts < 1:
        parser.error(f"--prompts must be >= 1, got {args.prompts}")
    args.low = args.low if args.low is not None else (2.0 if args.kind == "values" else 3.0)
    args.high = args.high if args.high is not None else (3.0 if args.kind == "values" else 4.0)
    if args.text == "essays" and (args.tokens < 64 or args.tokens % 64):
        parser.error(f"--tokens must be a positive multiple of 64, got {args.tokens}")
    if args.text == "needles" and args.tokens < 256:
        parser.error(f"--tokens must be at least 256 for needle prompts, got {args.tokens}")
    if not args.low < args.high:
        parser.error(f"--low ({args.low:g}) must be below --high ({args.high:g})")
    if not args.low <= args.mean <= args.high:
        parser.error(f"--mean {args.mean:g} must lie in [--low, --high] = [{args.low:g}, {args.high:g}]")
    for name in ("low", "high"):
        try:
            make_quantizer(args.kind, getattr(args, name))
        except (ValueError, TypeError) as exc:
            parser.error(f"--{name} {getattr(args, name):g} is not a width for {args.kind}: {exc}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(2)
    from kvweave.tools.data import essays_text, leading_token_ids
    from kvweave.tools.models import load_model

    model, tokenizer = load_model(args.model, device="cpu", progress=False)
    _, head_dim = shape_of(model)
    for bits in (args.low, args.high):
        if not valid_width(args.kind, bits, head_dim):
            raise SystemExit(f"{bits:g} bits: the {args.kind} quantizer refuses heads of width {head_dim}")
    if args.text == "needles":
        samples = needle_samples(model, tokenizer, args.prompts, args.tokens, args.seed)
        what = f"{args.prompts} needle prompts of ~{args.tokens} tokens (seed {args.seed}), at the answer digits"
    else:
        ids = torch.tensor([leading_token_ids(tokenizer, essays_text(), args.tokens)])
        if ids.shape[1] != args.tokens:
            raise SystemExit(f"the essays gave only {ids.shape[1]} tokens, fewer than --tokens {args.tokens}")
        samples, what = [Sample(ids, log_probs(model, ids))], f"{args.tokens} tokens"
    kl = kl_per_layer(model, samples, args.kind, [args.low, args.high])
    gains = [low - high for low, high in kl]
    weights = None
    if args.held:
        try:
            weights = held_tokens(model.config, args.held, args.kept, args.window)
        except ValueError as exc:
            raise SystemExit(f"--held: {exc}") from None
        if len(weights) != len(kl):
            raise SystemExit(f"--held: the config lists {len(weights)} layer types for {len(kl)} decoder layers")
        table = allocate_by_bytes(gains, weights, args.low, args.high, args.mean)
        windows = args.window or "the model's"
        what += f"; layers weighed by the tokens they hold after {args.held} ({args.kept:g} kept, windows {windows})"
    else:
        table = allocate(gains, args.low, args.high, args.mean)
    if args.kind == "values":
        table = [int(bits) for bits in table]
    print(f"\n{args.kind}, {args.model}, {what}: mean KL(exact || one layer quantized)\n")
    print(f"| layer | KL at {args.low:g} | KL at {args.high:g} | chosen bits |\n|---:|---:|---:|---:|")
    for layer, ((low, high), bits) in enumerate(zip(kl, table)):
        print(f"| {layer} | {low:.3e} | {high:.3e} | {bits:g} |")
    held = f", {weighted_mean(table, weights):.3g} over the tokens held" if weights else ""
    print(f"\nlayer_bits = {compact(table, args.kind)}  # mean {sum(table) / len(table):g}{held}")
    tables = {"allocated": table, "evenly spaced": evenly(len(table), args.low, args.high, args.mean)}
    if weights:  # as many wide layers as the byte table has, evenly spaced; and the unweighted table at --mean
        count = sum(1 for b in table if b == args.high)
        tables["evenly spaced"] = evenly(len(table), args.low, args.high, args.low + count * (args.high - args.low) / len(table))
        tables["by KL alone"] = allocate(gains, args.low, args.high, args.mean)
    tables |= {f"uniform {b:g}": [b] * len(table) for b in (args.low, args.high)}
    if valid_width(args.kind, args.mean, head_dim) and args.mean not in (args.low, args.high):
        tables[f"uniform {args.mean:g}"] = [args.mean] * len(table)
    whole = whole_model_kl(model, samples, None, args.kind, tables)
    print("\nall layers quantized: mean KL(exact || quantized)")
    for name, value in whole.items():
        held = f", {weighted_mean(tables[name], weights):.3g} over the tokens held" if weights else ""
        print(f"  {name:>14} (mean {sum(tables[name]) / len(table):g} bits{held}): {value:.4e}")
    if args.json:
        record = {**{k: getattr(args, k) for k in ("model", "kind", "tokens", "low", "high", "mean", "text", "prompts", "seed", "held", "kept", "window")},
                  "layer_weights": weights,
                  "kl_low": [k[0] for k in kl], "kl_high": [k[1] for k in kl], "layer_bits": table, "whole_model_kl": whole}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if all(math.isfinite(v) for v in whole.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
