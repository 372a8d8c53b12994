"""``minicache``: SLERP merge of adjacent layer pairs from mid-depth on, high-angle tokens kept unmerged.

MiniCache (Liu et al., 2024, "MiniCache: KV Cache Compression in Depth Dimension for Large Language
Models", arXiv:2405.14366): from the middle of the network on, the K (and V) states of each pair of
adjacent layers are merged per token: each vector is split into its magnitude and direction, the two
directions are interpolated by SLERP, ``e = sin((1-t) W)/sin(W) u_a + sin(t W)/sin(W) u_b`` (``W`` the
angle between the unit directions ``u_a, u_b``), and each layer is restored as its own magnitude times
the shared direction. Tokens whose directions differ too much to merge ("retention") are kept unmerged.

Here:

- Groups: layers ``0 .. start_layer - 1`` alone (stored as they are), then pairs ``(start_layer,
  start_layer + 1), ...``; an odd last layer stays alone. ``start_layer = -1`` means half the depth.
- Coefficients: the merged direction ``e`` [1, B, H, n, D] (``S = 1``) for a pair, the vectors themselves
  for a single layer; packed by the ``quantizer`` slot.
- State of a pair (batch on dim 0, counted in the cache's bytes): ``magnitudes`` float16 [B, H, T, 2]
  (each layer's norm per token), ``tokens`` int32 [B, 1] (tokens encoded), ``retained_at`` int32 [B, N]
  (the pair's token index of each retained token, -1 for padding when batch rows retain different
  counts) and ``retained`` float16 [B, N, 2, H, D], both layers' exact vectors of each retained token.
- Retention: a token is kept unmerged when the angle between its two layers' directions, averaged over
  the KV heads, is at least ``retain_angle`` degrees. Retained tokens decode exactly (up to float16).
"""

from __future__ import annotations

from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import BasisBuilder, ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import integer, number


def slerp(u: torch.Tensor, v: torch.Tensor, t: float) -> torch.Tensor:
    """Spherical interpolation of unit vectors ``u``, ``v`` [..., D] at ``t``; linear (renormalized) where
    they are nearly parallel, ``u`` where they are opposite."""
    cos = (u * v).sum(-1, keepdim=True).clamp(-1.0, 1.0)
    angle = torch.acos(cos)
    sin = torch.sin(angle)
    safe = sin > 1e-4
    ratio_u = torch.where(safe, torch.sin((1 - t) * angle) / sin.clamp_min(1e-4), torch.full_like(sin, 1 - t))
    ratio_v = torch.where(safe, torch.sin(t * angle) / sin.clamp_min(1e-4), torch.full_like(sin, t))
    out = ratio_u * u + ratio_v * v
    out = out / out.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    return torch.where(cos < -1 + 1e-6, u, out)


@attrs.frozen
class MiniCacheBasis(BasisBuilder):
    """Adjacent layer pairs from ``start_layer`` on share one SLERP-merged direction per token."""

    head_sharding: ClassVar[str] = (
        "whether a token stays unmerged is decided on the angle between its two "
        "layers averaged over all KV heads, a statistic no rank has"
    )

    start_layer: int = attrs.field(default=-1, validator=integer(-1), metadata={"doc": "first merged layer (-1: half the depth)"})
    t: float = attrs.field(default=0.6, validator=number(0.0, 1.0), metadata={"doc": "SLERP interpolation weight of the second layer of a pair"})
    retain_angle: float = attrs.field(default=100.0, validator=number(0.0, 180.0), metadata={"doc": "tokens whose two layers' directions are at least this far apart (degrees, mean over KV heads) stay unmerged"})

    def start(self, shape: ModelShape) -> int:
        return shape.num_layers // 2 if self.start_layer < 0 else self.start_layer

    def check_model(self, shape: ModelShape) -> None:
        if self.start(shape) > shape.num_layers - 2:
            raise ModelError(
                f"minicache: start_layer {self.start(shape)} leaves no pair of layers to merge in a model of "
                f"{shape.num_layers} layers; use start_layer <= {shape.num_layers - 2}"
            )

    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        first = self.start(shape)
        groups = [(layer,) for layer in range(first)]
        groups += [tuple(range(layer, min(layer + 2, shape.num_layers))) for layer in range(first, shape.num_layers, 2)]
        return groups

    def coefficient_width(self, shape: ModelShape) -> int:
        return shape.head_dim

    def coefficient_rows(self, group_size: int) -> int:
        return 1

    def init_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        if x.shape[0] == 1:
            return {}
        if x.shape[0] != 2:
            raise CacheStateError(f"minicache: groups are single layers or pairs, got {x.shape[0]} layers")
        batch, heads, dim = x.shape[1], x.shape[2], x.shape[-1]
        return {
            "magnitudes": torch.zeros(batch, heads, 0, 2, dtype=torch.float16, device=x.device),
            "tokens": torch.zeros(batch, 1, dtype=torch.int32, device=x.device),
            "retained_at": torch.zeros(batch, 0, dtype=torch.int32, device=x.device),
            "retained": torch.zeros(batch, 0, 2, heads, dim, dtype=torch.float16, device=x.device),
        }

    def angles(self, x: torch.Tensor) -> torch.Tensor:
        """Angle in degrees between the two layers' directions, mean over KV heads: [B, n]."""
        u = x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        cos = (u[0] * u[1]).sum(-1).clamp(-1.0, 1.0)  # [B, H, n]
        return torch.rad2deg(torch.acos(cos)).mean(dim=1)

    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 5:
            raise ValueError(f"minicache expects x shaped [G, B, H, n, D], got {tuple(x.shape)}")
        if x.shape[0] == 1:
            return x.float()
        work = x.float()
        norms = work.norm(dim=-1, keepdim=True)  # [2, B, H, n, 1]
        u = work / norms.clamp_min(1e-12)
        merged = slerp(u[0], u[1], self.t)
        offset = int(state["tokens"][0, 0])
        retain = self.angles(work) >= self.retain_angle  # [B, n]
        counts = retain.sum(-1)
        width = int(counts.max()) if counts.numel() else 0
        if width:
            batch = work.shape[1]
            at = torch.full((batch, width), -1, dtype=torch.int32, device=x.device)
            values = torch.zeros(batch, width, 2, work.shape[2], work.shape[-1], dtype=torch.float16, device=x.device)
            for b in range(batch):
                index = retain[b].nonzero().flatten()
                at[b, : len(index)] = (index + offset).to(torch.int32)
                values[b, : len(index)] = work[:, b, :, index].permute(2, 0, 1, 3).to(torch.float16)
            state["retained_at"] = torch.cat((state["retained_at"], at), dim=1)
            state["retained"] = torch.cat((state["retained"], values), dim=1)
        state["magnitudes"] = torch.cat((state["magnitudes"], norms.squeeze(-1).permute(1, 2, 3, 0).to(torch.float16)), dim=2)
        state["tokens"] = state["tokens"] + x.shape[-2]
        return merged.unsqueeze(0)

    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        if not state:  # a single layer
            return coefficients[0]
        count = coefficients.shape[-2]
        stop = start + count
        if stop > state["magnitudes"].shape[2]:
            raise CacheStateError(f"minicache: decode asked for tokens {start}..{stop}, only {state['magnitudes'].shape[2]} encoded")
        magnitudes = state["magnitudes"][:, :, start:stop, member].to(coefficients.dtype).unsqueeze(-1)
        out = coefficients[0] * magnitudes
        at = state["retained_at"]
        inside = (at >= start) & (at < stop)
        if bool(inside.any()):
            b, i = inside.nonzero(as_tuple=True)
            out = out.clone()
            out[b, :, (at[b, i] - start).long()] = state["retained"][b, i, member].to(out.dtype)
        return out


@hookimpl
def kvweave_register_bases(registrar) -> None:
    registrar.add("minicache", MiniCacheBasis)
