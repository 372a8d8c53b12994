"""``sigmoid-multilevel``: DepthWeave-KV's token-conditional depth router (Eq. 2), with several levels.

DepthWeave-KV: Token-Adaptive Cross-Layer Residual Factorization for Long-Context KV Cache
Compression (Córdoba et al., 2026, arXiv:2607.06523), Section 3.

Per token, layer and KV head of a block, features ``phi`` (all [G, B, H, n]):

- ``mass``: attention mass the recent queries give the token, relative to the block's mean (log1p);
- ``spike``: the largest attention probability a recent query gives it, relative to the block's largest;
- ``boundary``: 1 for delimiter / instruction-boundary tokens (from the token ids);
- ``probe``: the window's last attention-output error (Eq. 3) for that head;
- ``miss``: how much of the vector the shared basis misses, ``||x - x_hat|| / ||x||`` (not in the paper's
  list; it tells which tokens a residual helps most).

Score ``s = sigmoid(u . phi + bias)``; level ``j`` (ascending ranks) when ``s > tau_j + delta``, with
``tau_j`` evenly spaced in (0, 1) and ``delta`` the smallest shift that keeps the block's residual bytes
within its budget: the paper's adaptive threshold ``tau_m`` chosen to satisfy the memory budget. The shift is
found on the device with no host read (:func:`budget_shift`: the crossings ``s - tau_j`` sorted, their added
bytes summed in that order), where a bisection read the bytes back thirty times a block. ``u``, ``bias`` and
the residual gates come from ``kvweave train`` (``weights = PATH``); without a weights file the untrained
defaults below are used.
The router implements :class:`kvweave.core.trainable.TrainableRouter`, through which ``kvweave train``
fits it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.host_to_device import device_constant
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.lazy import torch
from kvweave.core.params import choice, int_tuple, number, shipped_path

FEATURES = ("mass", "spike", "boundary", "probe", "miss")
DEFAULT_WEIGHTS = (1.5, 2.0, 1.5, 4.0, 3.0)
DEFAULT_BIAS = -2.0


def _levels(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, tuple) or not value or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"'{attribute.alias}' must be a list of integers, got {value!r}")
    if list(value) != sorted(set(value)) or value[0] != 0:
        raise ValueError(f"'{attribute.alias}' must be strictly increasing and start at 0, got {list(value)}")


SHIPPED = Path(__file__).with_name("weights")


def resolve_weights_path(path: str) -> Path:
    """``builtin:NAME`` is a file shipped with kvweave (plugins/routers/weights/NAME.json); anything else a path."""
    return shipped_path(path, SHIPPED, ".json", "file")


def load_weights(path: str) -> dict[str, Any]:
    """Read a router weights file written by ``kvweave train``."""
    file = resolve_weights_path(path)
    if not file.is_file():
        raise ValueError(f"'weights' file {file} does not exist (write one with 'kvweave train')")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"'weights' file {file} is not valid JSON: {exc}") from exc
    missing = {"features", "u", "bias", "gates"} - set(data)
    if missing or list(data["features"]) != list(FEATURES) or len(data["u"]) != len(FEATURES):
        raise ValueError(f"'weights' file {file} is not a sigmoid-multilevel weights file (features {list(FEATURES)})")
    return data


@attrs.frozen
class SigmoidMultilevelRouter(Router):
    """Residual rank by sigmoid(u . phi) with byte-budgeted thresholds over several levels."""

    head_sharding: ClassVar[str] = "rank-budget"

    levels_: tuple[int, ...] = attrs.field(
        default=(0, 2, 4, 8), converter=int_tuple, validator=_levels, alias="levels",
        metadata={"doc": "residual ranks, ascending from 0"},
    )
    target_reduction_: float = attrs.field(
        default=8.5, validator=number(1.0, 1000.0), alias="target_reduction",
        metadata={"doc": "stored bytes must stay below 16-bit bytes / this, every tensor counted"},
    )
    weights: str = attrs.field(
        default="", metadata={"doc": "router weights from 'kvweave train': a path, or builtin:NAME for a shipped file ('' = untrained)"}
    )
    use_gates: bool = attrs.field(default=True, metadata={"doc": "apply the trained residual gates"})
    use_attention: bool = attrs.field(default=True, metadata={"doc": "use the attention mass and spike features"})
    use_boundaries: bool = attrs.field(default=True, metadata={"doc": "use the delimiter feature (needs the tokenizer)"})
    scoring: str = attrs.field(
        default="learned", validator=choice(("learned", "random")),
        metadata={"doc": "'random': scores ignore the token (the budget-matched 'w/o router' ablation)"},
    )
    _trained: dict[str, Any] | None = attrs.field(init=False, default=None, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        for name in ("use_gates", "use_attention", "use_boundaries"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"'{name}' must be true or false, got {getattr(self, name)!r}")
        if not isinstance(self.weights, str):
            raise TypeError(f"'weights' must be a path (a string), got {self.weights!r}")
        if self.weights:
            object.__setattr__(self, "_trained", load_weights(self.weights))

    @property
    def needs_attention(self) -> bool:  # type: ignore[override]
        return self.use_attention and self.scoring == "learned"

    @property
    def needs_boundaries(self) -> bool:  # type: ignore[override]
        return self.use_boundaries and self.scoring == "learned"

    def check_model(self, shape: ModelShape) -> None:
        if self.levels_[-1] > shape.head_dim:
            raise ModelError(f"router 'sigmoid-multilevel': level {self.levels_[-1]} exceeds head_dim {shape.head_dim}")
        gates = (self._trained or {}).get("gates")
        if gates:
            for kind in ("keys", "values"):
                rows = gates[kind]
                if len(rows) != shape.num_layers or any(len(row) != shape.num_kv_heads for row in rows):
                    raise ModelError(
                        f"router weights {self.weights} hold {kind} gates for {len(rows)} layers x "
                        f"{len(rows[0]) if rows else 0} KV heads; this model has {shape.num_layers} x {shape.num_kv_heads}"
                    )
                if any(not 0.0 <= g <= 1.0 for row in rows for g in row):
                    raise ModelError(f"router weights {self.weights}: {kind} gates must lie in [0, 1]")

    def levels(self) -> tuple[int, ...]:
        return self.levels_

    def target_reduction(self) -> float | None:
        return self.target_reduction_

    def gates(self, layer: int, kind: str) -> torch.Tensor | None:
        if not self.use_gates or self._trained is None:
            return None
        return torch.tensor(self._trained["gates"][kind][layer], dtype=torch.float32)

    # ------------------------------------------------- kvweave.core.trainable.TrainableRouter
    def feature_names(self) -> tuple[str, ...]:
        """The names of the features of :meth:`features`, in order (``FEATURES``)."""
        return FEATURES

    def initial_weights(self) -> tuple[tuple[float, ...], float]:
        """The untrained ``u`` (len(FEATURES) floats) and ``bias``: what the router scores with when no
        ``weights`` file is given (``DEFAULT_WEIGHTS``, ``DEFAULT_BIAS``)."""
        return DEFAULT_WEIGHTS, DEFAULT_BIAS

    def features(self, block: RouteBlock) -> torch.Tensor:
        """phi [G, B, H, n, len(FEATURES)] for ``block`` (absent features are zeros)."""
        shape = block.vectors.shape[:-1]
        zeros = torch.zeros(shape, device=block.vectors.device)
        mass = spike = boundary = probe = zeros
        if self.use_attention and block.attention_mass is not None:
            mass = torch.log1p(block.attention_mass / block.attention_mass.mean(dim=-1, keepdim=True).clamp_min(1e-9))
            spike = block.attention_spike / block.attention_spike.amax(dim=-1, keepdim=True).clamp_min(1e-9)
        if self.use_boundaries and block.boundary is not None:
            boundary = block.boundary[None, :, None, :].expand(shape)
        if block.probe_error is not None:
            probe = block.probe_error[:, None, :, None].expand(shape)
        miss = block.miss if block.miss is not None else zeros
        return torch.stack((mass, spike, boundary, probe, miss), dim=-1)

    def scores(self, block: RouteBlock) -> torch.Tensor:
        if self.scoring == "random":  # same budget, ranks not conditioned on the token
            generator = torch.Generator().manual_seed(block.layers[0] * 7919 + block.vectors.shape[-2])
            return torch.rand(block.vectors.shape[:-1], generator=generator).to(block.vectors.device)
        weights = self._trained["u"] if self._trained else DEFAULT_WEIGHTS
        u = device_constant(weights, torch.float32, block.vectors.device)
        bias = self._trained["bias"] if self._trained else DEFAULT_BIAS
        return torch.sigmoid(self.features(block) @ u + bias)

    def assign(self, block: RouteBlock) -> torch.Tensor:
        scores = self.scores(block)
        levels = device_constant(self.levels_, torch.int64, scores.device)
        thresholds = torch.linspace(0, 1, len(self.levels_) + 1, device=scores.device)[1:-1]
        over = scores.unsqueeze(-1) - thresholds  # a token reaches level j + 1 where its shift is below over[..., j]
        if block.budget_bytes is None:
            return levels[(over > 0).sum(dim=-1)]
        cost = [0.0] + [float(block.level_bytes[r]) for r in self.levels_[1:]]
        return levels[(over > budget_shift(over, cost, block.budget_bytes)).sum(dim=-1)]


def budget_shift(over: torch.Tensor, cost: list[float], budget: float) -> torch.Tensor:
    """The smallest shift ``delta`` (a 0-d tensor on ``over``'s device) for which the levels ``(over > delta).sum(-1)``
    cost at most ``budget`` bytes, ``cost[k]`` being an entry's bytes at level ``k`` (non-decreasing, ``cost[0]``
    nothing); ``-inf`` where every token's highest level fits. Crossing ``over[..., j]`` adds ``cost[j + 1] -
    cost[j]`` bytes, so the bytes at a shift are the sum of the added bytes of the crossings above it: with the
    crossings sorted from the highest, the shift is the first crossing whose running sum passes the budget. Read
    from the device nowhere (a GPU's flush would wait on it), where a bisection read the bytes thirty times."""
    added = [high - low for low, high in zip(cost, cost[1:])]
    if any(step < 0 for step in added):
        raise ValueError(f"sigmoid-multilevel: residual entry bytes by level {cost} fall as the rank rises; the "
                         "budget's shift needs them non-decreasing")
    crossings = over.reshape(-1, len(added))
    steps = device_constant(added, torch.float64, over.device).expand(crossings.shape).reshape(-1)
    ordered, order = torch.sort(crossings.reshape(-1), descending=True, stable=True)
    spent = torch.cumsum(steps[order], dim=0)
    fits = torch.searchsorted(spent, float(budget), right=True)  # a 0-d tensor; the budget sent as a scalar argument
    last = ordered.numel() - 1
    # index_select, not ordered[fits]: indexing by a 0-d tensor reads it on the host
    shift = ordered.index_select(0, fits.clamp(max=last).view(1)).squeeze(0)
    return shift.masked_fill(fits > last, float("-inf"))


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("sigmoid-multilevel", SigmoidMultilevelRouter)
