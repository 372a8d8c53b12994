"""The arithmetic of ``kvweave train``: the logistic fit of a router's ``u``, ``bias``, its held-out
evaluation (AUC, top-fraction accuracy) and the residual gates. Pure tensor functions, no model, no cache.

Shapes: ``N`` training rows (tokens x layers x KV heads x kinds), ``F`` router features, ``H`` KV heads,
``L`` layers; ``[B, H, T, D]`` the packed tokens of one layer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

TOP_FRACTION = 0.25


def top_fraction(values: torch.Tensor, groups: torch.Tensor, fraction: float = TOP_FRACTION) -> torch.Tensor:
    """1.0 where ``values`` [N] is among the top ``fraction`` of its group (``groups`` [N] ids), else 0.0."""
    out = torch.zeros_like(values, dtype=torch.float32)
    for group in groups.unique():
        index = (groups == group).nonzero().squeeze(1)
        out[index[values[index].topk(math.ceil(fraction * len(index))).indices]] = 1.0
    return out


def gate_terms(exact: torch.Tensor, without: torch.Tensor, with_residuals: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``<x - x0, r>`` and ``<r, r>`` per head [H], for x, x0, x0 + r shaped [B, H, T, D]."""
    residual = with_residuals.float() - without.float()
    error = exact.float() - without.float()
    return (error * residual).sum(dim=(0, 2, 3)), (residual * residual).sum(dim=(0, 2, 3))


def gates_from(numerator: torch.Tensor, denominator: torch.Tensor) -> torch.Tensor:
    """``clamp(num / den, 0, 1)``, 1 where no residual was seen (den = 0)."""
    safe = denominator.clamp_min(1e-30)
    return torch.where(denominator > 0, numerator / safe, torch.ones_like(numerator)).clamp(0.0, 1.0)


@dataclass
class Sample:
    """One sample's training rows and gate sums."""

    phi: torch.Tensor  # [N, F] router features
    target: torch.Tensor  # [N] 1.0 = label in the top fraction of its block
    block: torch.Tensor  # [N] routed-block id within the sample
    numerator: torch.Tensor  # [2, L, H] <x - x0, r> (keys, values)
    denominator: torch.Tensor  # [2, L, H] <r, r>


def fit_logistic(phi: torch.Tensor, target: torch.Tensor, steps: int = 200, lr: float = 0.05,
                 init: tuple[Sequence[float], float] | None = None, progress: bool = False) -> tuple[list[float], float]:
    """``u`` (F floats), ``bias`` of ``sigmoid(phi @ u + bias)`` fitted to ``target`` [N] from ``phi`` [N, F]
    by full-batch Adam on BCE, started from ``init`` (``(u, bias)``; None: zeros)."""
    from tqdm.auto import tqdm

    weights, bias = init or ([0.0] * phi.shape[-1], 0.0)
    u = torch.tensor(list(weights), dtype=torch.float32, requires_grad=True)
    b = torch.tensor(float(bias), requires_grad=True)
    optimizer = torch.optim.Adam([u, b], lr=lr)
    phi, target = phi.float(), target.float()
    for _ in tqdm(range(steps), desc="fitting u", disable=not progress, leave=False):
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(phi @ u + b, target)
        loss.backward()
        optimizer.step()
    return [float(v) for v in u.detach()], float(b.detach())


def auc(scores: torch.Tensor, target: torch.Tensor) -> float:
    """Area under the ROC curve (Mann-Whitney, ties counted half); NaN with one class only."""
    positive = target.bool()
    n_pos, n_neg = int(positive.sum()), int((~positive).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = torch.unique(scores.double(), return_inverse=True, return_counts=True)
    ends = counts.cumsum(0).double()
    ranks = (ends - (counts.double() - 1) / 2)[inverse]
    return float((ranks[positive].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(sample: Sample, u: Sequence[float], bias: float) -> dict[str, float]:
    """AUC, and how often "in the top 25 % of its block by score" matches the target."""
    scores = sample.phi.float() @ torch.tensor(list(u), dtype=torch.float32) + bias
    chosen = top_fraction(scores, sample.block)
    return {"auc": auc(scores, sample.target), "accuracy": float((chosen == sample.target).float().mean())}
