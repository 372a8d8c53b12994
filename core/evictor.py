"""The evictor interface: which tokens leaving the exact window are stored at all.

An evictor is its own pipeline slot (``evictor``), composable with any basis, quantizer and router: at a
flush it sees an :class:`EvictionBlock` and returns which tokens to keep. Dropped tokens are never
stored (their bytes leave ``memory_bytes()``) and attention no longer sees them; the router then gives
residual ranks to the kept tokens only. ``none`` (the default when a pipeline names no evictor) keeps
every token. Shapes: ``G`` layers of the basis group, ``B`` batch, ``H`` KV heads, ``n`` tokens, ``D``
head dim.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

import attrs

from kvweave.core.interfaces import Component
from kvweave.core.lazy import torch


@attrs.frozen
class EvictionBlock:
    """What an evictor sees of the tokens of one basis group that are leaving the exact window.

    ``keys`` [G, B, H, n, D] float32; ``valid`` [G, B, H, n] False for padding and filler slots;
    ``positions`` [G, B, H, n] each token's position among its row's real tokens (-1 where not valid);
    ``attention_mass``/``attention_spike`` [G, B, H, n] the summed and the largest attention probability
    of the observed recent queries (evictors with ``needs_attention``); ``scores`` [G, B, H, n] the
    attention each token received so far (evictors with ``accumulates``); ``boundary`` [B, n] delimiter
    flags when the cache knows the token ids; ``row_tokens`` [B] the real tokens each row has cached, this
    forward's included; ``window_tokens`` the tokens that stay exact after this flush; ``stored`` how many
    leading tokens of the block are already stored (re-offered to evictors with ``reselects``); ``held``
    [G] the slots each layer already stores outside the block; ``forward_tokens`` the tokens of the
    forward pass that flushes (1 while decoding); ``shared_tokens`` whether the group's layers share
    coefficient rows (a token is then kept for all of them if any keeps it); ``importance`` [G, B, H, n]
    each token's context importance (``+inf`` where none was scored: tokens fed after the scored forward,
    layers the scorer cannot see whole) and ``context_importance`` [L, B, H, T] every layer's scores of the
    scored forward (budgets shared between layers), both for evictors with ``needs_importance`` once the
    cache was fed by ``kvweave.engine.importance.prefill`` (None otherwise).
    """

    layers: tuple[int, ...]
    keys: torch.Tensor
    valid: torch.Tensor
    positions: torch.Tensor
    row_tokens: torch.Tensor
    window_tokens: int
    attention_mass: torch.Tensor | None = None
    attention_spike: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    boundary: torch.Tensor | None = None
    stored: int = 0
    held: tuple[int, ...] = ()
    forward_tokens: int = 0
    shared_tokens: bool = False
    importance: torch.Tensor | None = None
    context_importance: torch.Tensor | None = None


class Evictor(Component):
    """Chooses the tokens a cache stores at all (the others are dropped, their bytes freed)."""

    group: ClassVar[str] = "evictors"
    #: false only for ``none``: the engine then never asks and keeps every token
    evicts: ClassVar[bool] = True
    #: whether ``keep`` needs the attention statistics of recent queries (the cache then observes them)
    needs_attention: ClassVar[bool] = False
    #: whether the cache should accumulate, per stored token, the attention every query gives it (H2O)
    accumulates: ClassVar[bool] = False
    #: whether ``keep`` needs each token's context importance (engine/importance.py scores the context
    #: before the forward that fills the cache, with the evictor's ``chunk`` and ``sinks`` where it has them,
    #: else 2,048 and 4)
    needs_importance: ClassVar[bool] = False
    #: whether ``keep`` decides each layer of a block on its own (what it keeps of one layer does not depend on the
    #: block's other layers): the cache may then ask once for a block of several one-layer groups (a prompt's
    #: flushes stored together, :mod:`kvweave.engine.together`)
    layer_local: ClassVar[bool] = False
    #: whether ``keep`` reads the block's keys; False: the cache may decide for layers whose keys it does not hold
    #: yet (a scored context's layers, all at once: :mod:`kvweave.engine.together`), handing a block whose ``keys``
    #: have no channels [G, B, H, n, 0]
    reads_keys: ClassVar[bool] = True
    #: whether stored tokens are offered again at every flush (they may then be dropped; needs a basis
    #: with single-layer groups and a router without residual levels)
    reselects: ClassVar[bool] = False

    def prepare_importance(self, scores: torch.Tensor) -> torch.Tensor:
        """The context importance [L, B, H, T] this evictor chooses by, made once from the scorer's (``+inf``
        entries must stay ``+inf``); the default takes them as they are."""
        return scores

    def kept_leading(self) -> int:
        """How many positions at the start of every sequence :meth:`keep` always keeps (0, the default: none
        promised). The engine then knows, without reading the host, that an evicting flush's first slots hold those
        positions in order, so a router's ranks fixed by position (``Router.fixed_ranks``) apply to them; a flush whose
        ``keep`` breaks the promise is refused."""
        return 0

    def check_window(self, recent_window: int, block_tokens: int, where: str) -> None:
        """Raise :class:`BudgetError` if the evictor's token budget cannot hold the pipeline's exact window."""

    @abstractmethod
    def keep(self, block: EvictionBlock) -> torch.Tensor:
        """Which tokens of ``block`` to store: bool [G, B, H, n] (padding and filler slots are dropped
        whatever the answer)."""

