"""The component interfaces a pipeline is assembled from.

Every component is an attrs ``@frozen`` class whose fields are its registry.toml parameters; the
methods below are what the cache engine calls. Tensor shapes use these names:

- ``B`` batch, ``H`` KV heads, ``n`` tokens in a block, ``D`` head dim, ``r`` coefficient width,
  ``G`` layers in a basis group, ``C`` any channel width a quantizer is given.

A compressed token of one layer and head is stored as
``coefficients`` (``r`` values, packed by the ``quantizer`` slot) plus, when the router gives it a rank
``rho > 0``, a residual of ``rho`` channels (indices + values packed by the ``residual_quantizer`` slot).
The key/value vector is reconstructed as ``basis.decode(coefficients) + residual``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import attrs
import torch

from .errors import ModelError


@attrs.frozen
class ModelShape:
    """What a component may know of the model it compresses for (read from its config)."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "unknown"

    @property
    def kv_bytes_per_token_16bit(self) -> int:
        """Bytes a 16-bit full cache holds per token, keys and values of every layer and head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2


class Component(ABC):
    """Common base of every component. ``group`` names the registration hook's group."""

    group: ClassVar[str] = ""

    def check_model(self, shape: ModelShape) -> None:
        """Raise :class:`ModelError` if this component cannot work on a model of this shape."""


class Quantizer(Component):
    """Packs the last axis of a tensor into bytes, and back.

    ``quantize`` takes ``x`` shaped ``[..., C]`` and returns named packed tensors whose leading dims
    equal ``x``'s (so the cache can concatenate them along the token axis); ``dequantize`` inverts it.
    """

    group: ClassVar[str] = "quantizers"

    @abstractmethod
    def quantize(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """``x`` [..., C] -> packed fields, each [..., k] with the same leading dims."""

    @abstractmethod
    def dequantize(self, packed: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Packed fields -> [..., C] in ``dtype``."""

    @abstractmethod
    def bytes_per_vector(self, width: int, dtype: torch.dtype) -> float:
        """Stored bytes of one packed vector of ``width`` values given in ``dtype``."""

    def check_width(self, width: int, where: str) -> None:
        """Raise :class:`ModelError` if vectors of ``width`` values cannot be packed; ``where`` names the use."""


class BasisBuilder(Component):
    """Turns key/value vectors ``[D]`` into coefficients ``[r]`` and back, per group of layers.

    Layers of one group (``layer_groups``) are encoded together once every one of them has the block;
    ``state`` is the builder's stored tensors for one group and one of K/V (e.g. the shared bases),
    counted in the cache's bytes.
    """

    group: ClassVar[str] = "bases"

    def layer_groups(self, shape: ModelShape) -> list[tuple[int, ...]]:
        """The groups of layers encoded together; each layer in exactly one group. Default: one each."""
        return [(layer,) for layer in range(shape.num_layers)]

    @abstractmethod
    def coefficient_width(self, shape: ModelShape) -> int:
        """``r``, the number of coefficients per token, head and (stored) layer."""

    def init_state(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """Build the stored state from the group's first block ``x`` [G, B, H, n, D]."""
        return {}

    @abstractmethod
    def encode(self, state: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """``x`` [G, B, H, n, D] -> coefficients [S, B, H, n, r] (S = G, or 1 when shared by the group)."""

    @abstractmethod
    def decode(self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int) -> torch.Tensor:
        """coefficients [S, B, H, n, r] -> the ``member``-th layer's vectors [B, H, n, D]."""


class Router(Component):
    """Chooses the residual rank of every compressed token."""

    group: ClassVar[str] = "routers"

    @abstractmethod
    def levels(self) -> tuple[int, ...]:
        """The residual ranks this router assigns, ascending (0 = no residual)."""

    @abstractmethod
    def assign(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """Ranks for a block ``x`` [B, H, n, D] of ``layer``: a long tensor [B, H, n] of values in ``levels()``."""


class Probe(Component):
    """Watches the attention output online and reports it to the router. ``none`` does nothing."""

    group: ClassVar[str] = "probes"

    def observe(self, layer: int, step: int, queries: torch.Tensor | None) -> None:
        """Called once per decode step and layer; may record statistics."""


class AttentionKernel(Component):
    """How attention reads the stored cache.

    ``materializes`` is true for the reference path, where the cache's ``update`` returns
    reconstructed K/V and the model's own attention runs on them.
    """

    group: ClassVar[str] = "kernels"
    materializes: ClassVar[bool] = True


GROUP_INTERFACES: dict[str, type[Component]] = {
    "bases": BasisBuilder,
    "routers": Router,
    "quantizers": Quantizer,
    "probes": Probe,
    "kernels": AttentionKernel,
}

# Pipeline slot -> the component group it takes.
SLOT_GROUPS: dict[str, str] = {
    "basis": "bases",
    "quantizer": "quantizers",
    "router": "routers",
    "residual_quantizer": "quantizers",
    "probe": "probes",
    "kernel": "kernels",
}


def require_divides(part: int, whole: int, what: str, where: str) -> None:
    """Raise :class:`ModelError` unless ``part`` divides ``whole``."""
    if whole % part != 0:
        raise ModelError(f"{where}: {what} {part} does not divide {whole}; choose a divisor of {whole}")
