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
``tau_j`` evenly spaced in (0, 1) and ``delta`` the smallest shift (found by bisection) that keeps the
block's residual bytes within its budget: the paper's adaptive threshold ``tau_m`` chosen to satisfy the
memory budget. ``u``, ``bias`` and the residual gates come from ``kvweave train`` (``weights = PATH``);
without a weights file the untrained defaults below are used.
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
from kvweave.core.interfaces import ModelShape, RouteBlock, Router
from kvweave.core.lazy import torch
from kvweave.core.params import choice, int_tuple, number

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
    if path.startswith("builtin:"):
        name = path.removeprefix("builtin:")
        file = SHIPPED / f"{name}.json"
        if not file.is_file():
            shipped = sorted(p.stem for p in SHIPPED.glob("*.json"))
            raise ValueError(f"'weights' names unknown shipped file '{name}'; shipped: {', '.join(shipped) or '(none)'}")
        return file
    return Path(path).expanduser()


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
        u = torch.tensor(self._trained["u"] if self._trained else DEFAULT_WEIGHTS, device=block.vectors.device)
        bias = self._trained["bias"] if self._trained else DEFAULT_BIAS
        return torch.sigmoid(self.features(block) @ u + bias)

    def assign(self, block: RouteBlock) -> torch.Tensor:
        scores = self.scores(block)
        levels = torch.tensor(self.levels_, device=scores.device)
        cost = torch.tensor([0.0] + [block.level_bytes[r] for r in self.levels_[1:]], device=scores.device)
        thresholds = torch.linspace(0, 1, len(self.levels_) + 1, device=scores.device)[1:-1]

        def level_index(delta: float) -> torch.Tensor:
            return (scores.unsqueeze(-1) > thresholds + delta).sum(dim=-1)

        delta = 0.0
        if block.budget_bytes is not None:
            if float(cost[level_index(-1.0)].sum()) > block.budget_bytes:
                low, high = -1.0, 1.0  # find the smallest shift that fits the budget
                for _ in range(30):
                    middle = (low + high) / 2
                    if float(cost[level_index(middle)].sum()) > block.budget_bytes:
                        low = middle
                    else:
                        high = middle
                delta = high
            else:
                delta = -1.0  # the budget allows every token its score's highest level
        return levels[level_index(delta)]


@hookimpl
def kvweave_register_routers(registrar) -> None:
    registrar.add("sigmoid-multilevel", SigmoidMultilevelRouter)
