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


def _logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits [..., H, (Hq/H) * q, T] of queries [..., Hq, q, D] (those of KV head h together) on keys [..., H, T, D]."""
    *lead, q_heads, observed, dim = queries.shape
    heads = keys.shape[-3]
    return queries.reshape(*lead, heads, q_heads // heads * observed, dim) @ keys.transpose(-1, -2) * scale


def _outputs(block_logits: torch.Tensor, block_values: torch.Tensor, context_logits: torch.Tensor,
             context_values: torch.Tensor) -> torch.Tensor:
    """Attention output over [block + context] from the two parts' logits, without joining the keys or values."""
    weights = torch.cat((block_logits, context_logits), -1).softmax(dim=-1)
    n = block_logits.shape[-1]
    return weights[..., :n] @ block_values + weights[..., n:] @ context_values


def _context_logits(queries: torch.Tensor, context_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries' logits on the context, causal: the queries are the context's last ``q`` positions, and the block
    comes before all of it, so only the context is masked."""
    q_heads, observed = queries.shape[-3], queries.shape[-2]
    heads, total = context_keys.shape[-3], context_keys.shape[-2]
    logits = _logits(queries, context_keys, scale)
    query_pos = (total - observed + torch.arange(observed, device=context_keys.device)).repeat(q_heads // heads)
    return logits.masked_fill(torch.arange(total, device=context_keys.device)[None, :] > query_pos[:, None], float("-inf"))


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
        tensors = (queries, keys, values, approx_keys, approx_values, context_keys, context_values)
        return self.measure_group(*(t.unsqueeze(0) for t in tensors), scale)[0]

    def measure_group(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None):
        """Every layer of the group in one pass; the context's logits are computed once for both attentions."""
        scale = scale or queries.shape[-1] ** -0.5
        context = _context_logits(queries, context_keys, scale)
        block = _logits(queries, keys, scale)
        approx_block = block if approx_keys is keys else _logits(queries, approx_keys, scale)  # values probed: keys exact
        exact = _outputs(block, values, context, context_values)
        approx = _outputs(approx_block, approx_values, context, context_values)
        error = (exact - approx).flatten(-2).norm(dim=-1) / (exact.flatten(-2).norm(dim=-1) + 1e-6)  # [G, B, H]
        return error.mean(dim=1)

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
