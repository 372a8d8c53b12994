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
from kvweave.core.linalg import tall_product
from kvweave.core.params import integer, number


def _logits(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Logits [..., H, (Hq/H) * q, T] of queries [..., Hq, q, D] (those of KV head h together) on keys [..., H, T, D]."""
    *lead, q_heads, observed, dim = queries.shape
    heads = keys.shape[-3]
    return queries.reshape(*lead, heads, q_heads // heads * observed, dim) @ keys.transpose(-1, -2) * scale


#: the largest block weights [G, B, H, rows, n] (float32 bytes) a keys measurement keeps for the values one of the same
#: block; larger ones keep only their log-normalizers, and the values measurement recomputes the block's logits
KEEP_WEIGHTS_BYTES = 128 << 20


def _weights(block_logits: torch.Tensor, context_logits: torch.Tensor, normalizer: bool = False):
    """Softmax over [block + context] from the two parts' logits: the block's weights and the context's (views of one
    tensor), and where asked the log-normalizer [..., rows] (else None)."""
    logits = torch.cat((block_logits, context_logits), -1)
    weights, n = logits.softmax(dim=-1), block_logits.shape[-1]
    return weights[..., :n], weights[..., n:], logits.logsumexp(-1) if normalizer else None


def _context_logits(queries: torch.Tensor, context_keys: torch.Tensor, scale: float) -> torch.Tensor:
    """The queries' logits on the context, causal: the queries are the context's last ``q`` positions, and the block
    comes before all of it, so only the context is masked."""
    q_heads, observed = queries.shape[-3], queries.shape[-2]
    heads, total = context_keys.shape[-3], context_keys.shape[-2]
    logits = _logits(queries, context_keys, scale)
    query_pos = (total - observed + torch.arange(observed, device=context_keys.device)).repeat(q_heads // heads)
    return logits.masked_fill(torch.arange(total, device=context_keys.device)[None, :] > query_pos[:, None], float("-inf"))


def _weighted(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weights`` [..., rows, n] times the block's ``values`` [..., n, D]: few rows over a long block, so summed over
    the block in chunks on a GPU (:func:`kvweave.core.linalg.tall_product`)."""
    return tall_product(weights.transpose(-1, -2), values)


def _heads_norm(output: torch.Tensor) -> torch.Tensor:
    """Per (layer, row, KV head): the norm of an output [..., H, rows, D] over its query heads and queries."""
    return output.flatten(-2).norm(dim=-1)


@attrs.frozen
class AttentionOutputProbe(Probe):
    """Relative attention-output error of each encoded block, steering the budget between windows."""

    head_sharding: ClassVar[str] = "rank-budget"

    needs_queries = True
    shares_products = True

    interval: int = attrs.field(default=1, validator=integer(1), metadata={"doc": "probe every n-th block of a window"})
    tolerance: float = attrs.field(default=0.05, validator=number(0.0, 10.0), metadata={"doc": "error above which a window gets more budget"})
    patience: int = attrs.field(default=3, validator=integer(1), metadata={"doc": "probes below tolerance before the share shrinks"})
    step: float = attrs.field(default=0.25, validator=number(0.0, 4.0), metadata={"doc": "relative change of a window's share per adjustment"})
    min_share: float = attrs.field(default=0.25, validator=number(0.0, 1.0), metadata={"doc": "smallest budget share of a window"})
    max_share: float = attrs.field(default=4.0, validator=number(1.0, 100.0), metadata={"doc": "largest budget share of a window"})

    def wants(self, flush_index: int) -> bool:
        return flush_index % self.interval == 0

    def reads_other(self, kind: str, shared: dict | None) -> bool:
        """The values' measurement reads the exact keys only to recompute the block's weights, which the keys'
        measurement keeps up to ``KEEP_WEIGHTS_BYTES``."""
        return not (kind == "values" and shared is not None and "weights" in shared)

    def measure(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None):
        grouped = [t.unsqueeze(0) for t in (queries, keys, values, context_keys, context_values)]
        approx = [grouped[1] if approx_keys is keys else approx_keys.unsqueeze(0),
                  grouped[2] if approx_values is values else approx_values.unsqueeze(0)]
        return self.measure_group(*grouped[:3], *approx, *grouped[3:], scale)[0]

    def measure_group(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None,
                      shared=None):
        """Every layer of the group in one pass; the context's logits are computed once for both attentions. Where the
        keys are exact (``approx_keys is keys``: the values measured) the outputs differ only in the block's part, the
        same weights times the other values. ``shared`` (a dict) keeps from the keys' measurement what the values' one
        takes: the exact attention's block weights (or their log-normalizers, past ``KEEP_WEIGHTS_BYTES``), the block's
        part of its output and the output's norm; the values' measurement is then one product with the block."""
        scale = scale or queries.shape[-1] ** -0.5
        # the values' measurement may come without the keys (``reads_other``): the block's shape is the values'
        kept = self._kept(shared, queries, keys if keys is not None else values, context_keys)
        if keys is None and (kept is None or kept.get("weights") is None):
            raise ValueError("probe 'attention-output': a values' measurement without the keys needs the block's weights "
                             "kept by the keys' measurement of the same block (reads_other)")
        if approx_keys is keys and kept is not None:
            weights = kept.get("weights")
            if weights is None:
                weights = (_logits(queries, keys, scale) - kept["norm"][..., None]).exp()
            difference, exact_norm = kept["exact_block"] - _weighted(weights, approx_values), kept["exact_norm"]
        else:
            context = _context_logits(queries, context_keys, scale)
            block = _logits(queries, keys, scale)
            keep = shared is not None and block.numel() * block.element_size() <= KEEP_WEIGHTS_BYTES
            weights, context_weights, norm = _weights(block, context, normalizer=shared is not None and not keep)
            del block
            exact_block = _weighted(weights, values)
            exact = exact_block + context_weights @ context_values
            if approx_keys is keys:
                difference = exact_block - _weighted(weights, approx_values)
            else:
                approx_weights, approx_context, _ = _weights(_logits(queries, approx_keys, scale), context)
                del context
                difference = exact - (_weighted(approx_weights, approx_values) + approx_context @ context_values)
            exact_norm = _heads_norm(exact)
            if shared is not None:
                shared.clear()
                shared.update(shapes=self._shapes(queries, keys, context_keys), exact_block=exact_block, exact_norm=exact_norm)
                if keep:
                    shared["weights"] = weights
                else:
                    shared["norm"] = norm
        error = _heads_norm(difference) / (exact_norm + 1e-6)  # [G, B, H]
        return error.mean(dim=1)

    @staticmethod
    def _shapes(queries, keys, context_keys) -> tuple:
        return tuple(queries.shape), tuple(keys.shape), tuple(context_keys.shape)

    def _kept(self, shared, queries, keys, context_keys) -> dict | None:
        """What an earlier measurement of the same block left in ``shared`` (None: nothing); refuses a dict left by a
        block of other shapes, which would give another block's weights."""
        if not shared:
            return None
        made = shared.get("shapes")
        if made != self._shapes(queries, keys, context_keys):
            raise ValueError(f"probe 'attention-output': the products shared between a block's keys and values were "
                             f"made for shapes {made}, not {self._shapes(queries, keys, context_keys)} "
                             "(queries, block, context)")
        return shared

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
