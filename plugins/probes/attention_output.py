"""``attention-output``: DepthWeave-KV's online error tracking with attention-output probes (Eq. 3).

DepthWeave-KV (Córdoba et al., 2026, arXiv:2607.06523), Section 3: every p steps, recent queries are
evaluated against the compressed cache and a higher-fidelity reference; above a tolerance the window's
threshold drops (more tokens promoted), below it for several intervals it rises.

Reference (the paper leaves it open): the probe runs when a block leaves the exact window, while its
exact keys and values still exist. For the last ``observe_queries`` queries of each layer it compares
attention over [exact block + exact window] with attention over [stored block + exact window], per KV
head: ``e = ||O - O_hat|| / (||O|| + eps)``. No extra copy is kept for the reference, so nothing extra
is stored; compressed tokens cannot be promoted later, so the feedback acts on the next blocks. A
window whose error exceeds ``tolerance`` gets a larger share of the byte budget (its thresholds drop);
after ``patience`` probes below tolerance its share shrinks. Shares are renormalized to average 1, so the
pipeline's total budget still holds.
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import Probe
from kvweave.core.lazy import torch
from kvweave.core.params import integer, number


def _attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last ``q`` positions: queries [B, Hq, q, D] over keys/values [B, H, T, D]."""
    batch, q_heads, observed, dim = queries.shape
    heads, total = keys.shape[1], keys.shape[-2]
    grouped = queries.reshape(batch, heads, q_heads // heads * observed, dim)
    logits = grouped @ keys.transpose(-1, -2) * scale
    query_pos = (total - observed + torch.arange(observed, device=keys.device)).repeat(q_heads // heads)
    logits = logits.masked_fill(torch.arange(total, device=keys.device)[None, :] > query_pos[:, None], float("-inf"))
    return logits.softmax(dim=-1) @ values  # [B, H, (Hq/H) * q, D]


@attrs.frozen
class AttentionOutputProbe(Probe):
    """Relative attention-output error of each encoded block, steering the budget between windows."""

    head_sharding: ClassVar[str] = "rank-budget"

    needs_queries = True

    interval: int = attrs.field(default=1, validator=integer(1), metadata={"doc": "probe every n-th block of a window"})
    tolerance: float = attrs.field(default=0.05, validator=number(0.0, 10.0), metadata={"doc": "error above which a window gets more budget"})
    patience: int = attrs.field(default=3, validator=integer(1), metadata={"doc": "probes below tolerance before the share shrinks"})
    step: float = attrs.field(default=0.25, validator=number(0.0, 4.0), metadata={"doc": "relative change of a window's share per adjustment"})
    min_share: float = attrs.field(default=0.25, validator=number(0.0, 1.0), metadata={"doc": "smallest budget share of a window"})
    max_share: float = attrs.field(default=4.0, validator=number(1.0, 100.0), metadata={"doc": "largest budget share of a window"})

    def wants(self, flush_index: int) -> bool:
        return flush_index % self.interval == 0

    def measure(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None):
        scale = scale or queries.shape[-1] ** -0.5
        exact = _attention(queries, torch.cat((keys, context_keys), -2), torch.cat((values, context_values), -2), scale)
        approx = _attention(queries, torch.cat((approx_keys, context_keys), -2), torch.cat((approx_values, context_values), -2), scale)
        error = (exact - approx).flatten(2).norm(dim=-1) / (exact.flatten(2).norm(dim=-1) + 1e-6)  # [B, H]
        return error.mean(dim=0)

    def adjust(self, share: float, errors: torch.Tensor, state: dict[str, float]) -> float:
        worst = float(errors.max())
        state["last"] = worst
        if worst > self.tolerance:
            state["calm"] = 0
            share *= 1 + self.step
        else:
            state["calm"] = state.get("calm", 0) + 1
            if state["calm"] >= self.patience:
                state["calm"] = 0
                share /= 1 + self.step
        return min(self.max_share, max(self.min_share, share))


@hookimpl
def kvweave_register_probes(registrar) -> None:
    registrar.add("attention-output", AttentionOutputProbe)
