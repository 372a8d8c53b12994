"""``head-mode``: FreqDepthKV's budgeted head router (shared-depth, residual-depth or exact per head and block).

FreqDepthKV ("FreqDepthKV: frequency-guided depth sharing for robust KV cache compression", seeds/002,
Section 3, Eqs. (2)-(3)). For each block of layers and each KV head (and batch row), the candidate modes
are

- ``shared``: only the depth-shared coefficient (nothing routed);
- ``residual`` at each fraction ``f`` of ``residual_fractions``: the ``ceil(f n)`` tokens with the largest
  logit-perturbation score ``s_t = max_q |q . (k_t - k_hat_t)| * scale`` keep their high-frequency rows
  (the rows whose column of the basis's mixing matrix is not constant over the layers: ``Z_1 .. Z_{G-1}``
  for ``dct-depth``; every layer's deviation for ``dct-depth`` ``mode = "average"``);
- ``exact``: every token keeps every row (the DC's quantization error included), i.e. the block is
  restored up to the residual quantizer.

Eq. (2): ``L(m) = mean over the block's layers of (1/|P|) sum_{q in P} ||q K_hat(m)^T scale - q K^T scale||^2
+ lambda Omega(m)``, with ``P`` the probe's query positions (``RouteBlock.queries``, causal: a query only
sees keys at or before its position), ``K_hat(shared)`` the decoded coefficients, a residual mode's
selected tokens counted as restored, ``exact`` as 0; ``Omega(m)`` the mode's routed bytes divided by
the 16-bit bytes of the head's block. The loss is computed on keys and the decision applied to the
values of the same block (the values block reuses the keys' losses and scores; only if the values'
budget is smaller is the decision redone for it). ``lambda`` is the smallest value (found exactly, on the
device, among the lambdas where two modes' objectives cross) whose decisions keep the block's routed bytes
within its budget, which the engine derives from ``target_reduction`` (stored bytes of everything against a
16-bit cache, per block group: the engine budgets each group separately, so ``lambda`` is found per group,
not once for the whole model).

Once decided (on the first block a group encodes, the whole prefill when the prompt is compressed in
one flush), the head modes are kept for later blocks (decoding) and only the residual tokens are chosen
anew; with ``refresh_every = N > 0`` they are re-decided once a group has encoded N more tokens, and
whenever the kept modes would exceed a block's budget.

Ablation switches: ``loss = "norm"`` (key reconstruction error ``||k - k_hat||^2`` instead of logits, and
``||k - k_hat||`` as the token score), ``allow_exact = false``, ``allow_residual = false`` (shared or
exact only), ``static = true`` (no head routing: every head of a block gets the same mode, the most
expensive one whose bytes fit the budget).

Ranks: ``levels() = (0, rank)``; a routed row is stored at ``rank`` channels (``rank = head_dim``: the
whole row, no channel indices).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.lazy import torch
from kvweave.core.params import choice, integer, number

LOSSES = ("logit", "norm")


def _fractions(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise TypeError(f"'{attribute.alias}' must be a list of numbers, got {value!r}")
    if any(not 0.0 < v < 1.0 for v in value) or list(value) != sorted(set(value)):
        raise ValueError(f"'{attribute.alias}' must be strictly increasing fractions in (0, 1), got {list(value)}")


def _to_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _boolean(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"'{attribute.alias}' must be true or false, got {value!r}")


@attrs.frozen
class ModeTable:
    """Candidate modes of one block: ``loss`` [B, H, M], ``cost`` [M] routed bytes per head, ``omega`` [M]."""

    names: tuple[str, ...]
    tokens: torch.Tensor  # [M] tokens kept per head
    rows: torch.Tensor  # [M, G] bool: rows kept
    loss: torch.Tensor
    cost: torch.Tensor
    omega: torch.Tensor


def decide(loss: torch.Tensor, omega: torch.Tensor, cost: torch.Tensor, budget: float | None) -> tuple[torch.Tensor, float]:
    """Eq. (2) per head: ``argmin_m loss[.., m] + lambda omega[m]`` with the smallest ``lambda >= 0`` whose total
    ``cost`` fits ``budget``. Modes are ordered by cost, so ties go to the cheaper one. Returns (modes, lambda).

    Exact, with one host read (lambda): the total cost changes only at a lambda where two modes' objectives cross on
    some head, so the crossings are sorted and the first interval between them whose modes fit is found by a binary
    search on the device (the total cost falls as lambda grows); the modes are those inside that interval. Where
    several heads cross at the same lambda they switch together."""
    if budget is None:
        return loss.argmin(dim=-1), 0.0
    flat = loss.reshape(-1, loss.shape[-1])
    crossings = (flat.unsqueeze(-1) - flat.unsqueeze(-2)) / (omega.unsqueeze(0) - omega.unsqueeze(1))  # [heads, a, b]
    valid = torch.isfinite(crossings) & (crossings > 0)
    beyond = torch.where(valid, crossings, 0.0).amax() * 2 + 1  # past every crossing: each head's cheapest best mode
    ordered = torch.where(valid, crossings, beyond).reshape(-1).sort().values  # [K]
    inside = torch.cat((ordered.new_zeros(1), (ordered[:-1] + ordered[1:]) / 2, beyond.reshape(1)))  # a lambda in each interval
    starts = torch.cat((ordered.new_zeros(1), ordered))  # each interval's smallest lambda
    low = torch.zeros((), dtype=torch.long, device=loss.device)
    high = torch.full((), inside.numel() - 1, dtype=torch.long, device=loss.device)
    for _ in range(math.ceil(math.log2(inside.numel()))):
        middle = (low + high) // 2
        fits = cost[(loss + inside[middle] * omega).argmin(dim=-1)].sum() <= budget
        high = torch.where(fits, middle, high)
        low = torch.where(fits, low, middle + 1)
    return (loss + inside[high] * omega).argmin(dim=-1), float(starts[high])


@attrs.frozen
class HeadModeRouter(Router):
    """Shared-depth / residual-depth / exact per (block, head), by the logit loss of Eq. (2) under a byte budget."""

    head_sharding: ClassVar[str] = "rank-budget"

    rank: int = attrs.field(default=64, validator=integer(1, 256), metadata={"doc": "channels of a routed row (= head_dim: whole rows, no indices; exact mode is exact only then)"})
    target_reduction_: float = attrs.field(
        default=3.8, validator=number(1.0, 1000.0), alias="target_reduction",
        metadata={"doc": "stored bytes must stay below 16-bit bytes / this, every tensor counted"},
    )
    residual_fractions: tuple[float, ...] = attrs.field(
        default=(0.0625, 0.125, 0.25, 0.5), converter=_to_tuple, validator=_fractions,
        metadata={"doc": "token fractions r of the residual-depth modes (top-scored tokens keep their high frequencies)"},
    )
    loss: str = attrs.field(default="logit", validator=choice(LOSSES), metadata={"doc": "'logit': Eq. (2) on key-induced logits at the probe's queries; 'norm': key reconstruction error (ablation)"})
    allow_exact: bool = attrs.field(default=True, validator=_boolean, metadata={"doc": "offer the exact mode"})
    allow_residual: bool = attrs.field(default=True, validator=_boolean, metadata={"doc": "offer the residual-depth modes"})
    static: bool = attrs.field(default=False, validator=_boolean, metadata={"doc": "no head routing: every head of a block the same mode, the most expensive that fits (ablation)"})
    refresh_every: int = attrs.field(default=0, validator=integer(0), metadata={"doc": "re-decide the head modes after this many more tokens of a group (0: decide once)"})
    chunk_tokens: int = attrs.field(default=2048, validator=integer(1), metadata={"doc": "tokens per chunk when scoring (bounds memory)"})

    def __attrs_post_init__(self) -> None:
        if not self.allow_exact and not self.allow_residual:
            raise ValueError("'allow_exact' and 'allow_residual' are both false: only the shared mode would be left; use router 'uniform' with rank 0 for that")

    def check_model(self, shape: ModelShape) -> None:
        if self.rank > shape.head_dim:
            raise ModelError(f"router 'head-mode': rank {self.rank} exceeds the model's head_dim {shape.head_dim}; use rank = {shape.head_dim}")

    def levels(self) -> tuple[int, ...]:
        return (0, self.rank)

    def target_reduction(self) -> float | None:
        return self.target_reduction_

    # ---------------------------------------------------------------------------------- scoring
    def token_errors(self, block: RouteBlock) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token: its share of the shared mode's loss, averaged over the block's layers, [B, H, n], and its
        score [B, H, n] (largest logit perturbation over probe queries and layers; for 'norm' the largest
        error norm)."""
        if block.approx is None:
            raise ValueError("router 'head-mode' needs the decoded block (RouteBlock.approx); the engine gives it")
        g, b, h, n, d = block.vectors.shape
        errors, scores = [], []
        logit = self.loss == "logit"
        if logit and (block.queries is None or block.query_positions is None):
            raise ValueError(
                "router 'head-mode' with loss = 'logit' needs the model's queries (RouteBlock.queries); use a probe "
                "that observes them (probe 'prefill-logit') and build the cache with build_cache(pipeline, model), "
                "or set loss = 'norm'"
            )
        for start in range(0, n, self.chunk_tokens):
            stop = min(n, start + self.chunk_tokens)
            delta = (block.vectors[..., start:stop, :] - block.approx[..., start:stop, :]).float()
            if not logit:
                squared = delta.pow(2).sum(-1)  # [G, B, H, c]
                errors.append(squared.mean(0))
                scores.append(squared.sqrt().amax(0))
                continue
            queries = block.queries.float()  # [G, B, Hq, P, D]
            per = queries.shape[2] // h
            observed = queries.shape[3]
            grouped = queries.reshape(g, b, h, per * observed, d)
            scale = block.query_scale or d**-0.5
            perturbation = grouped @ delta.transpose(-1, -2) * scale  # [G, B, H, m, c]
            positions = block.query_positions.long().to(delta.device).repeat(1, 1, per)  # [G, B, m]
            keys_at = block.first + torch.arange(start, stop, device=delta.device)
            visible = keys_at[None, None, None, :] <= positions[..., None]  # [G, B, m, c]
            perturbation = perturbation * visible.unsqueeze(2)
            errors.append((perturbation.pow(2).sum(-2) / (per * observed)).mean(0))
            scores.append(perturbation.abs().amax(-2).amax(0))
        return torch.cat(errors, -1), torch.cat(scores, -1)

    def table(self, block: RouteBlock, errors: torch.Tensor, scores: torch.Tensor) -> tuple[ModeTable, torch.Tensor]:
        """The candidate modes with their losses and bytes, and each token's place in the score order [B, H, n]."""
        g, b, h, n, d = block.vectors.shape
        device = errors.device
        if block.mixing is None:
            high = [True] * g if g > 1 else [False]
        else:
            mixing = block.mixing
            high = [not bool(torch.allclose(mixing[:, k], mixing[0, k].expand(g))) for k in range(g)]
        order = scores.argsort(dim=-1, descending=True)
        place = torch.empty_like(order)
        place.scatter_(-1, order, torch.arange(n, device=device).expand_as(order))
        kept = errors.gather(-1, order).cumsum(-1)  # [B, H, n]
        shared_loss = errors.sum(-1)
        row_bytes = float(0 if block.level_bytes is None else block.level_bytes.get(self.rank, 0.0))
        names, tokens, rows, losses, costs = ["shared"], [0], [[False] * g], [shared_loss], [0.0]
        if self.allow_residual:
            for fraction in self.residual_fractions:
                count = min(n, math.ceil(fraction * n))
                names.append(f"residual-{fraction:g}")
                tokens.append(count if any(high) else 0)
                rows.append(high)
                losses.append(shared_loss - kept[..., count - 1] if any(high) else shared_loss)
                costs.append(count * sum(high) * row_bytes)
        if self.allow_exact:
            names.append("exact")
            tokens.append(n)
            rows.append([True] * g)
            losses.append(torch.zeros_like(shared_loss))
            costs.append(n * g * row_bytes)
        cost = torch.tensor(costs, dtype=torch.float64, device=device)
        return ModeTable(
            names=tuple(names),
            tokens=torch.tensor(tokens, device=device),
            rows=torch.tensor(rows, dtype=torch.bool, device=device),
            loss=torch.stack(losses, -1).double(),
            cost=cost,
            omega=cost / (n * g * 2 * d),
        ), place

    # ---------------------------------------------------------------------------------- decisions
    def choose(self, table: ModeTable, budget: float | None) -> tuple[torch.Tensor, float]:
        """Modes [B, H] (indices into ``table.names``) and the lambda they were found at (nan when static)."""
        if not self.static:
            return decide(table.loss, table.omega, table.cost, budget)
        heads = table.loss.shape[0] * table.loss.shape[1]
        fitting = [m for m in range(len(table.names)) if budget is None or float(table.cost[m]) * heads <= budget]
        best = max(fitting, key=lambda m: float(table.cost[m])) if fitting else 0
        return torch.full(table.loss.shape[:2], best, dtype=torch.long, device=table.loss.device), float("nan")

    def assign(self, block: RouteBlock) -> torch.Tensor:
        g, b, h, n, _ = block.vectors.shape
        state = block.state if block.state is not None else {}
        key = (block.first, n, g)
        if block.kind == "values" and state.get("scored_for") == key and state["errors"].shape == (b, h, n):
            errors, scores = state["errors"], state["scores"]  # Eq. (2) is computed on keys, applied to values
        else:
            errors, scores = self.token_errors(block)
            if block.kind == "keys":
                state.update(scored_for=key, errors=errors, scores=scores)
        table, place = self.table(block, errors, scores)

        def fits(modes: torch.Tensor) -> bool:
            return block.budget_bytes is None or float(table.cost[modes].sum()) <= block.budget_bytes

        modes = None
        if block.kind == "values" and state.get("decided_for") == key and fits(state["block_modes"]):
            modes = state["block_modes"]
        due = "modes" not in state or state["modes"].shape != (b, h) or (
            self.refresh_every > 0 and block.first + n - state["decided_at"] >= self.refresh_every
        )
        if modes is None and not due and fits(state["modes"]):
            modes = state["modes"]
        if modes is None:
            modes, lam = self.choose(table, block.budget_bytes)
            if block.kind == "keys":
                state.update(modes=modes, decided_at=block.first + n, decisions=state.get("decisions", 0) + 1, last_lambda=lam)
        if block.kind == "keys":
            state.update(block_modes=modes, decided_for=key, mode_names=table.names)
        if block.kind == "values":  # the keys' scores are not kept past their block
            for name in ("errors", "scores", "scored_for"):
                state.pop(name, None)
        selected = place < table.tokens[modes].unsqueeze(-1)  # [B, H, n]
        rows = table.rows[modes].permute(2, 0, 1)  # [G, B, H]
        return (selected.unsqueeze(0) & rows.unsqueeze(-1)).long() * self.rank


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("head-mode", HeadModeRouter)
