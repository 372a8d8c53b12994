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
from collections.abc import Container
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import attrs

from kvweave.core.errors import ModelError
from kvweave.core.lazy import torch
from kvweave.core.route_block import RouteBlock

__all__ = ["KINDS", "AttentionKernel", "BasisBuilder", "Component", "ModelShape", "PipelineSlots", "Probe", "Quantizer",
           "RouteBlock", "Router", "require_divides"]

if TYPE_CHECKING:
    from kvweave.core.view import LayerView

#: what a cache stores per token and head, in this order
KINDS = ("keys", "values")


class PipelineSlots(Protocol):
    """What :meth:`Component.check_pipeline` sees of a resolved pipeline (``ResolvedPipeline``)."""

    name: str
    settings: Any

    def component(self, slot: str) -> Component: ...

    def component_for(self, slot: str, kind: str) -> Component: ...

    def use(self, slot: str) -> str: ...


@attrs.frozen
class ModelShape:
    """What a component may know of the model it compresses for (read from its config)."""

    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "unknown"
    #: per layer, the sliding window of a sliding-window attention layer (it sees its last ``w`` tokens), 0 for
    #: a full-attention layer; empty: every layer attends over all tokens
    layer_windows: tuple[int, ...] = ()

    @property
    def kv_bytes_per_token_16bit(self) -> int:
        """Bytes a 16-bit full cache holds per token, keys and values of every layer and head."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 2

    @property
    def sliding_layers(self) -> dict[int, int]:
        """``{layer: window}`` of the sliding-window layers (the cache keeps their last ``window - 1``
        tokens exactly, as the model's own cache does, and compresses the other layers)."""
        return {layer: window for layer, window in enumerate(self.layer_windows) if window}

    def own_cache_tokens(self, tokens: int, exclude: Container[int] = ()) -> int:
        """Token-layers the model's own cache holds after ``tokens`` tokens: all of them in a full-attention
        layer, the last ``window - 1`` in a sliding-window one (transformers' ``DynamicSlidingWindowLayer``);
        the layers in ``exclude`` left out."""
        sliding = self.sliding_layers
        return sum(min(tokens, sliding[layer] - 1) if layer in sliding else tokens
                   for layer in range(self.num_layers) if layer not in exclude)

    def own_cache_bytes_16bit(self, tokens: int, batch: int, exclude: Container[int] = ()) -> int:
        """Bytes the model's own cache holds in 16 bits after ``tokens`` tokens of ``batch`` rows (the layers
        in ``exclude`` left out)."""
        return batch * self.own_cache_tokens(tokens, exclude) * 2 * self.num_kv_heads * self.head_dim * 2


class Component(ABC):
    """Common base of every component. ``group`` names the registration hook's group."""

    group: ClassVar[str] = ""
    #: how it works when a model's KV heads are split over tensor-parallel ranks: "head-local" (a head's
    #: storage depends on that head only), "rank-budget" (only a byte budget spans the heads), a sentence
    #: saying why it cannot, or None: undeclared, refused under tensor parallelism (engine/sharding.py). Read
    #: from the component's own class: a subclass declares it again
    head_sharding: ClassVar[str | None] = None

    def check_model(self, shape: ModelShape) -> None:
        """Raise :class:`ModelError` if this component cannot work on a model of this shape."""

    def check_pipeline(self, pipeline: PipelineSlots, slot: str) -> None:
        """Raise :class:`ComponentError` if this component, in ``slot``, cannot work with the pipeline's
        other components or settings; called when a pipeline is resolved (no model needed). The message
        names both slots."""


class Quantizer(Component):
    """Packs the last axis of a tensor into bytes, and back.

    ``quantize`` takes ``x`` shaped ``[..., C]`` and returns named packed tensors whose leading dims
    equal ``x``'s (so the cache can concatenate them along the token axis); ``dequantize`` inverts it.
    """

    group: ClassVar[str] = "quantizers"
    #: the layout of the packed fields, for kernels that read them in place (``LayerView`` carries it);
    #: a kernel declares the formats it reads, and a pipeline pairing it with another is refused when it
    #: is resolved. Give a new layout a new name (and a version where it could change). A quantizer whose
    #: parameters choose between layouts may make it a property of its instance (``rotated-token``'s scales).
    packed_format: ClassVar[str] = "opaque"
    #: such a quantizer names every layout its instances may write here (the contract tests check kernels'
    #: declarations against them); empty: ``packed_format`` is the only one
    packed_formats: ClassVar[tuple[str, ...]] = ()

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

    def for_kind(self, kind: str) -> Quantizer:
        """The quantizer to use for ``kind`` ("keys"/"values"); the same one by default (KIVI-style
        quantizers pack keys and values along different axes)."""
        return self

    def for_layer(self, layer: int) -> Quantizer:
        """The quantizer of ``layer``'s tokens (after :meth:`for_kind`); the same one by default. Quantizers
        with a per-layer table (``layer_bits``) return a copy with that layer's width: the cache encodes and
        decodes each layer with its own, so layers of one basis group must get equal ones."""
        return self

    def tokens_per_group(self) -> int:
        """Tokens that share one row of some packed field (scales over a group of tokens); 1 by default.
        The cache's ``block_tokens`` must be a multiple of it."""
        return 1

    def leading_tokens(self, packed: dict[str, torch.Tensor], tokens: int, total: int) -> dict[str, torch.Tensor]:
        """The packed fields of the first ``tokens`` of the ``total`` tokens ``packed`` holds (``tokens`` a multiple
        of :meth:`tokens_per_group`): what :meth:`quantize` gives for them. By default each field's rows along
        dim -2 are taken in proportion (a field holds ``total / r`` rows, each for ``r`` consecutive tokens); a
        quantizer whose fields lie otherwise overrides it."""
        out = {}
        for name, field in packed.items():
            rows = field.shape[-2] if field.dim() > 1 else 0
            if not rows or rows * tokens % total:
                raise ValueError(
                    f"{type(self).__name__}.leading_tokens: field '{name}' has {rows} rows for {total} tokens, so its first "
                    f"{tokens} tokens are not whole rows; override leading_tokens for this layout")
            out[name] = field[..., : rows * tokens // total, :]
        return out


class BasisBuilder(Component):
    """Turns key/value vectors ``[D]`` into coefficients ``[r]`` and back, per group of layers.

    Layers of one group (``layer_groups``) are encoded together once every one of them has the block;
    ``state`` is the builder's stored tensors for one group and one of K/V (e.g. the shared bases),
    counted in the cache's bytes, each with the batch on dim 0.
    """

    group: ClassVar[str] = "bases"
    #: coefficients are the vectors' own channels (what a quantizer weighing channels by the queries needs)
    keeps_channels: ClassVar[bool] = False
    #: ``encode`` returns its input and ``decode`` member ``m``'s coefficients: the engine then quantizes the block as
    #: it came, without a float32 copy of it
    identity: ClassVar[bool] = False
    #: ``init_state`` takes the group's first block as the model stored it (its dtype; the builder converts what it
    #: needs), not the engine's float32 copy
    reads_block: ClassVar[bool] = False

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
        """``x`` [G, B, H, n, D] -> coefficients [S, B, H, n, r] (S = G, or 1 when shared by the group).

        May update ``state`` in place (e.g. a new basis version); tokens encoded before must still
        decode as they did."""

    def coefficient_rows(self, group_size: int) -> int:
        """``S``: coefficient vectors stored per token for a group of ``group_size`` layers."""
        return group_size

    def residual_mixing(self, group_size: int) -> torch.Tensor | None:
        """An invertible ``M`` [G, G] when routed residuals live in another domain than the layers (e.g. depth
        frequencies): the group's misses ``E`` are stored as rows ``R = M^-1 E`` (row ``k`` in the lists of
        the group's ``k``-th layer, the router's ranks indexing rows) and layer ``m`` adds
        ``sum_k M[m, k] R_k``. None (default): each layer's residual is its own miss."""
        return None

    def factor_bases(self, state: dict[str, torch.Tensor], member: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For kernels that attend in coefficient space: the ``member``-th layer's bases [B, H, V, r, D] (a view
        of the stored state, ``k = c P_v`` for a token encoded with version ``v``) and the tokens encoded with
        each version, int32 [V] (versions cover consecutive token ranges). None (default): the basis does
        not decode as coefficients times a basis, and only the reference kernel can read it."""
        return None

    @abstractmethod
    def decode(
        self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, member: int, start: int = 0
    ) -> torch.Tensor:
        """coefficients [S, B, H, T, r] of the group's packed tokens ``start .. start + T`` (in encoding
        order) -> the ``member``-th layer's vectors [B, H, T, D], in the coefficients' dtype."""

    def decode_group(self, state: dict[str, torch.Tensor], coefficients: torch.Tensor, members: int, start: int = 0) -> torch.Tensor:
        """Every one of the group's ``members`` layers decoded, [G, B, H, T, D]: one :meth:`decode` a layer unless a
        basis does better."""
        return torch.stack([self.decode(state, coefficients, member, start) for member in range(members)])


class Router(Component):
    """Chooses the residual rank of every compressed token."""

    group: ClassVar[str] = "routers"
    #: whether ``assign`` needs the attention statistics of recent queries (the cache then observes them)
    needs_attention: ClassVar[bool] = False
    #: whether ``assign`` uses delimiter flags (the cache then needs the tokenizer and the token ids)
    needs_boundaries: ClassVar[bool] = False
    #: one byte budget for keys and values together (the keys block, routed first, may take what the values'
    #: coefficients of the same block leave); False: each keeps to its half of the target (engine/budget.py)
    pools_budget: ClassVar[bool] = False

    @abstractmethod
    def levels(self) -> tuple[int, ...]:
        """The residual ranks this router assigns, ascending (0 = no residual). Dropping tokens is the
        ``evictor`` slot's work (:mod:`kvweave.core.evictor`)."""

    @abstractmethod
    def assign(self, block: RouteBlock) -> torch.Tensor:
        """Ranks for ``block``: a long tensor [G, B, H, n] of values in ``levels()``."""

    def target_reduction(self) -> float | None:
        """The reduction against a 16-bit cache the stored bytes must reach, or None for no budget."""
        return None

    def routed_tokens(self, kind: str, first: int) -> int | None:
        """How many leading tokens of any ``kind`` block whose first position is ``first`` :meth:`assign` may give
        a rank above 0 (known without the block), or None for any of them (the default). The engine reconstructs
        and routes only those (rounded up to the quantizer's token groups); 0 skips the block's reconstruction."""
        return None

    def fixed_ranks(self, kind: str, first: int, tokens: int) -> tuple[tuple[int, int, int], ...] | None:
        """The ranks :meth:`assign` would give the ``tokens`` tokens of any ``kind`` block whose first position is
        ``first`` without reading the block, the same in every batch row and head: runs ``(start, stop, rank)`` of
        block positions, ascending and apart, every other token at rank 0. The engine then finds the residual entries
        without reading ranks on the host (a GPU's stream keeps running). None (the default): :meth:`assign` decides."""
        return None

    def gates(self, layer: int, kind: str) -> torch.Tensor | None:
        """Residual gates in [0, 1] for ``layer`` and ``kind`` ("keys"/"values"), [H], or None (all 1)."""
        return None


class Probe(Component):
    """Watches the attention output online and steers the residual budget between basis groups."""

    group: ClassVar[str] = "probes"
    #: whether the probe needs the recent queries (the cache then observes them)
    needs_queries: ClassVar[bool] = False
    #: whether ``select_queries`` uses delimiter flags (the cache then needs the tokenizer and the token ids)
    needs_boundaries: ClassVar[bool] = False
    #: whether the probe picks query positions of each forward for the router (``select_queries``)
    selects_queries: ClassVar[bool] = False
    #: whether ``measure_group`` takes ``shared``: a dict the engine hands to the keys measurement of a block and then
    #: to the values measurement of the same block, layers and queries, where products both need can be kept
    shares_products: ClassVar[bool] = False

    def select_queries(
        self, query: torch.Tensor, keys: torch.Tensor, boundary: torch.Tensor | None, scale: float | None
    ) -> torch.Tensor:
        """Positions [B, P] (indices into the forward's ``q`` new tokens) of the queries the router should
        use: ``query`` [B, Hq, q, D] the forward's queries, ``keys`` [B, H, T, D] every key they attend to
        (the last ``q`` being their own), ``boundary`` [B, q] delimiter flags (or None)."""
        raise NotImplementedError

    def wants(self, flush_index: int) -> bool:
        """Whether to measure at this flush of a group (the n-th time the group encodes a block)."""
        return False

    def measure(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, approx_keys: torch.Tensor,
        approx_values: torch.Tensor, context_keys: torch.Tensor, context_values: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Eq. (3) relative attention-output error per head, [H].

        ``queries`` [B, Hq, q, D] observed recent queries; ``keys``/``values`` [B, H, n, D] the exact block,
        ``approx_*`` the same block as stored; ``context_*`` [B, H, m, D] the other keys/values attended
        to (identical in both), the last of them being the queries' own positions; ``scale`` the softmax
        scale (None: D ** -0.5)."""
        raise NotImplementedError

    def measure_group(self, queries, keys, values, approx_keys, approx_values, context_keys, context_values, scale=None):
        """:meth:`measure` for a group's layers at once, [G, H]: every argument with a leading layer axis G (``queries``
        [G, B, Hq, q, D], the rest [G, B, H, ., D]). One call a layer unless a probe does better. A probe declaring
        ``shares_products`` takes one more keyword, ``shared`` (a dict, or None where the keys' measurement left none):
        the engine measures a block's keys with ``approx_values`` the exact values, then its values with ``approx_keys``
        the exact keys (the same object as ``keys``). The tensors are read-only: some are views of the cache's own
        window tokens and observed queries (one layer at a time, in their dtype), which a write would corrupt."""
        return torch.stack([self.measure(*(t[g] for t in (queries, keys, values, approx_keys, approx_values, context_keys,
                                                           context_values)), scale) for g in range(keys.shape[0])])

    def reads_other(self, kind: str, shared: dict | None) -> bool:
        """Whether measuring a block of ``kind`` reads the other kind's exact block, given what the keys' measurement
        left in ``shared`` (a ``shares_products`` probe). Where not, the engine passes None for it (the values'
        measurement: ``keys`` and ``approx_keys``) and makes no float32 copy of it."""
        return True

    def adjust(self, share: float, errors: torch.Tensor, state: dict[str, float]) -> float:
        """A group's new budget share (1.0 = fair) from its latest errors [G, H]; ``state`` persists."""
        return share


class AttentionKernel(Component):
    """How attention reads the stored cache.

    ``materializes`` is true for the reference path, where the cache's ``update`` returns
    reconstructed K/V and the model's own attention runs on them. A kernel that reads the packed storage
    in place declares the packed formats it reads (``coefficient_formats``, ``residual_formats``:
    :attr:`Quantizer.packed_format` names); a pipeline pairing it with any other is refused when it is
    resolved, with an error naming both slots.
    """

    group: ClassVar[str] = "kernels"
    materializes: ClassVar[bool] = True
    #: packed formats of the ``quantizer`` slot this kernel reads (empty: any, the kernel materializes)
    coefficient_formats: ClassVar[tuple[str, ...]] = ()
    #: packed formats of the ``residual_quantizer`` slot this kernel reads (empty: any)
    residual_formats: ClassVar[tuple[str, ...]] = ()
    #: whether a kernel that reads in place rotates keys stored before the rotary embedding
    #: (``key_space = "pre-rope"``); a materializing kernel always can (the engine rotates them back)
    pre_rope_keys: ClassVar[bool] = False
    #: whether a kernel that reads in place finds residual entries by the per-tile index (the cache then
    #: builds it and counts its bytes); False for a kernel that reads the entries' lists itself
    reads_residual_tiles: ClassVar[bool] = True
    #: whether the kernel reads a window kept for a CUDA graph (:attr:`LayerView.window_fill`: the exact tensors are
    #: buffers of a capacity, the window's length on the device), so that :mod:`kvweave.engine.graphs` can replay steps
    reads_window_fill: ClassVar[bool] = False

    @property
    def builds_residual_tiles(self) -> bool:
        """Whether the cache keeps the residual tile index for this kernel."""
        return not self.materializes and self.reads_residual_tiles

    def check_engine(self, engine: Any) -> None:
        """Raise :class:`ModelError` or :class:`ComponentError` when this kernel cannot read the storage
        of ``engine``'s pipeline on its model (called once, when the cache is built; what needs no model is
        checked by :meth:`check_pipeline` already)."""

    def storage_changed(self, scratch: dict, layers: tuple[int, ...]) -> None:
        """Called after a flush stored ``layers``' packed tokens anew: drop what this kernel keeps in ``scratch`` (the
        views' ``scratch``) that holds their previous storage, which would otherwise stay alive, a second copy of those
        layers, until each one's next decode step. Nothing by default."""

    def prepare(self, view: LayerView, device: torch.device) -> None:
        """Build now what :meth:`attend` would build on its first call over ``view``'s packed storage (what reads the
        device to the host: a CUDA graph's capture must find it built). Nothing by default."""

    def attend(self, view: LayerView, query: torch.Tensor, attention_mask: Any, scaling: float) -> torch.Tensor:
        """Decode attention of ``query`` [B, Hq, 1, D] over one layer's stored cache ``view``, read in place:
        [B, 1, Hq, D]. Called instead of the model's attention for one-token forwards when
        ``materializes`` is false."""
        raise NotImplementedError(f"kernel {type(self).__name__} does not attend over packed storage")


def require_divides(part: int, whole: int, what: str, where: str) -> None:
    """Raise :class:`ModelError` unless ``part`` divides ``whole``."""
    if whole % part != 0:
        raise ModelError(f"{where}: {what} {part} does not divide {whole}; choose a divisor of {whole}")
