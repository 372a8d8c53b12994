"""A typed, read-only view of one layer's packed storage: what kernels, metrics, training and tests read.

The engine (:mod:`kvweave.engine`) owns every stored tensor; anything outside it that needs the stored
bytes of a layer asks for ``cache.view(layer)`` (or ``engine.view(layer)``) and gets a
:class:`LayerView`. Its tensors are the stored ones (no copies: reading them costs nothing), and its
mappings are read-only, so nothing outside the engine can change what the cache holds.

Shapes: ``S`` coefficient rows of the layer's basis group (1 when its layers share them), ``B`` batch,
``H`` KV heads, ``T`` packed tokens, ``k`` a packed field's width, ``N`` residual entries, ``D`` head dim.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import attrs

from kvweave.core.errors import CacheStateError
from kvweave.core.lazy import torch


def frozen_map(fields: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """A read-only mapping of ``fields`` (empty for None)."""
    return MappingProxyType(dict(fields or {}))


@attrs.frozen
class ResidualLevelView:
    """The routed residual entries of one rank level.

    ``fields``: ``index`` uint8 [N, rank] in channel mode, and the residual quantizer's packed fields
    ``q_<name>`` [N, ...]. Where each entry is, ``row`` int32 [N] (``b * H + h``) and ``token`` int32 [N] (index
    among the layer's packed tokens), is held as bits, not stored per entry: :meth:`located` derives it.
    ``tile_start``/``tile_mask`` int32 [B * H, T / 32]: where each 32-token tile's entries start and which of its
    tokens have one (present when the pipeline's kernel reads in place).
    """

    rank: int
    fields: Mapping[str, torch.Tensor] = attrs.field(converter=frozen_map)
    tile_start: torch.Tensor | None = None
    tile_mask: torch.Tensor | None = None
    locate: Any = attrs.field(default=None, eq=False, repr=False)  # () -> (row, token), the engine's derivation

    @property
    def entries(self) -> int:
        return 0 if not self.fields else int(next(iter(self.fields.values())).shape[0])

    def located(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Each entry's ``row`` (``b * H + h``) and ``token`` (packed-token index), int32 [N] each, in the order of
        :attr:`fields`' entries (derived from the level's bits each call)."""
        if self.locate is None:
            raise CacheStateError(f"residual level {self.rank}'s view was built without the locations of its entries")
        return self.locate()

    def located_fields(self) -> dict[str, torch.Tensor]:
        """:attr:`fields` with ``row`` and ``token`` (:meth:`located`)."""
        if not self.entries:
            return dict(self.fields)
        row, token = self.located()
        return {"row": row, "token": token, **self.fields}


@attrs.frozen
class KindView:
    """One layer's stored keys or values.

    ``coefficients``: the quantizer's packed fields [S, B, H, T, k] of the layer's basis group, of which
    row ``coefficient_row`` decodes this layer; ``coefficient_format`` the quantizer's declared packed
    format (:attr:`kvweave.core.interfaces.Quantizer.packed_format`). ``basis_state`` the basis builder's
    stored tensors for the group (batch first); ``factor_bases`` ``(bases [B, H, V, r, D], tokens per
    version int32 [V])`` when the basis decodes as coefficients times bases, else None. ``residuals`` one
    view per rank level > 0 (ascending), packed in ``residual_format``; ``residual_basis`` [B, H, R, D]
    float16 in ``residual_mode = "basis"``; ``gates`` [H] the router's residual gates (None: all 1).
    ``exact`` [B, H, n_exact, D] the recent tokens as computed, in the model's dtype; ``quantizer`` the
    quantizer that packed ``coefficients``.
    """

    kind: str
    coefficients: Mapping[str, torch.Tensor] = attrs.field(converter=frozen_map)
    coefficient_row: int
    coefficient_format: str
    basis_state: Mapping[str, torch.Tensor] = attrs.field(converter=frozen_map)
    factor_bases: tuple[torch.Tensor, torch.Tensor] | None
    residuals: tuple[ResidualLevelView, ...]
    residual_format: str
    residual_basis: torch.Tensor | None
    gates: torch.Tensor | None
    exact: torch.Tensor | None
    #: the quantizer that packed ``coefficients`` (a kernel reads its parameters: bits, groups, levels)
    quantizer: Any = None


@attrs.frozen
class LayerView:
    """One layer's packed storage, keys and values.

    ``packed_tokens`` slots stored per batch row and head (before the exact window); ``passed_tokens``
    logical tokens that left the exact window (stored or evicted); ``positions`` int16 or int32 [B, H,
    packed_tokens], each slot's logical position (-1: filler), present once an evictor dropped tokens;
    ``group``/``member`` the layer's basis group and its place in it; ``flushes`` how many blocks the
    group has encoded (changes whenever the storage grows); ``scratch`` a dict a kernel may keep derived
    tables in between calls (cleared when the batch changes; never counted as the cache's bytes, so
    keep only what can be rebuilt). ``key_space``: ``"post-rope"`` (keys stored as the model computed
    them) or ``"pre-rope"`` (stored before the rotary embedding; a reader rotates them at each slot's
    cache index: ``positions``, or ``0 .. packed_tokens - 1`` when there are none). ``scores`` float32
    [B, H, packed + exact]: the attention every query gave each held token, for an evictor that
    accumulates it (H2O), else None.
    """

    layer: int
    group: int
    member: int
    packed_tokens: int
    passed_tokens: int
    flushes: int
    keys: KindView
    values: KindView
    positions: torch.Tensor | None
    scratch: dict
    key_space: str = "post-rope"
    scores: torch.Tensor | None = None
    #: keys stored before RoPE: the model's rotary embedding (:class:`kvweave.engine.rotary.RotaryInverse`)
    rotary: Any = None
    #: a window kept for a CUDA graph (:mod:`kvweave.engine.graphs`): int32 [1] on the device, the tokens it held before
    #: this step's; ``keys.exact`` / ``values.exact`` are then buffers of its capacity, their first ``fill + 1`` rows
    #: the window this step attends (the rest unwritten). None: the exact tensors are the window itself
    window_fill: Any = None

    @property
    def exact_tokens(self) -> int:
        """Tokens held exactly after the packed ones (the recent window)."""
        if self.window_fill is not None:
            raise CacheStateError(f"layer {self.layer}: the window is kept for a CUDA graph; its length is on the device "
                                  "(window_fill + 1 rows of the exact buffers)")
        exact = self.keys.exact
        return 0 if exact is None else int(exact.shape[-2])

    def kind(self, name: str) -> KindView:
        """The view of ``"keys"`` or ``"values"``."""
        if name not in ("keys", "values"):
            raise KeyError(f"a layer view holds 'keys' and 'values', not {name!r}")
        return self.keys if name == "keys" else self.values

    @property
    def batch(self) -> int:
        exact = self.keys.exact
        return 0 if exact is None else int(exact.shape[0])

    @property
    def heads(self) -> int:
        exact = self.keys.exact
        return 0 if exact is None else int(exact.shape[1])
