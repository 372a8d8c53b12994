"""Per-layer bit tables from per-layer gains: the allocations ``benchmarks/layer_sensitivity.py`` makes from its
measured sensitivities (by count of layers, or by the tokens each layer holds), the blind table it compares them with,
and their TOML form."""

from __future__ import annotations

from typing import Any


def allocate(gains: list[float], low: float, high: float, mean: float) -> list[float]:
    """Bits per layer: ``low`` everywhere except the round((mean - low) / (high - low) * L) layers of the
    largest ``gains``, which get ``high`` (ties go to the earlier layer)."""
    if not low < high:
        raise ValueError(f"low ({low}) must be below high ({high})")
    if not low <= mean <= high:
        raise ValueError(f"mean ({mean}) must lie in [low, high] = [{low}, {high}]")
    count = round((mean - low) / (high - low) * len(gains))
    order = sorted(range(len(gains)), key=lambda layer: (-gains[layer], layer))
    chosen = set(order[:count])
    return [high if layer in chosen else low for layer in range(len(gains))]


def allocate_by_bytes(gains: list[float], weights: list[float], low: float, high: float, mean: float) -> list[float]:
    """Bits per layer whose mean weighted by ``weights`` (what each layer stores: the tokens it holds) is at most
    ``mean``: layers move from ``low`` to ``high`` in order of gain per weight (ties to the earlier layer), each that
    still fits the budget; a layer that holds few tokens widens cheaply. Equal weights give :func:`allocate`'s table
    where its count is whole, one ``high`` layer fewer where it rounded up."""
    if len(weights) != len(gains):
        raise ValueError(f"{len(weights)} weights for {len(gains)} layers")
    if any(not w > 0 for w in weights):
        raise ValueError(f"layer weights must be positive, got {weights}")
    allocate([0.0], low, high, mean)  # the same refusals
    budget = (mean - low) * sum(weights) * (1 + 1e-9)
    table = [low] * len(gains)
    for layer in sorted(range(len(gains)), key=lambda i: (-gains[i] / weights[i], i)):
        cost = (high - low) * weights[layer]
        if cost <= budget:
            table[layer], budget = high, budget - cost
    return table


def held_tokens(config: Any, context: int, kept: float, window: int | None) -> list[float]:
    """The tokens each layer of a model with ``config`` holds after a ``context``-token prompt: ``context * kept`` in a
    full-attention layer, ``min(context, window)`` in a sliding-window one (``window``: the model's own where None)."""
    text = getattr(config, "text_config", config)
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    slide = window or getattr(text, "sliding_window", None)
    if "sliding_attention" in types and not slide:
        raise ValueError("the model has sliding-window layers but no sliding_window in its config; give --window")
    return [float(min(context, slide)) if kind == "sliding_attention" else context * kept for kind in types]


def weighted_mean(table: list[float], weights: list[float]) -> float:
    """``table``'s mean weighted by ``weights``."""
    return sum(b * w for b, w in zip(table, weights)) / sum(weights)


def evenly(layers: int, low: float, high: float, mean: float) -> list[float]:
    """The same count of ``high`` layers as :func:`allocate`, evenly spaced: a blind table at the same mean."""
    count = len([b for b in allocate([0.0] * layers, low, high, mean) if b == high])
    chosen = {int((i + 0.5) * layers / count) for i in range(count)}
    return [high if layer in chosen else low for layer in range(layers)]


def compact(bits: list[float], kind: str) -> str:
    """A TOML list: ints for values, floats (3.0, 3.25) for keys."""
    return "[" + ", ".join(str(int(b)) if kind == "values" else repr(float(b)) for b in bits) + "]"
