"""``TrainableRouter``: what ``kvweave train`` needs of a router to fit its scoring weights and gates.

A trainable router is a :class:`~kvweave.core.interfaces.Router` that scores each token of a routed block
as ``sigmoid(phi @ u + bias)`` from ``F`` named features ``phi``, and reads back what ``kvweave train``
wrote: a JSON weights file (the router's own parameter, e.g. ``weights = PATH``) holding

- ``features``: ``feature_names()`` (so a file is refused by a router with other features);
- ``u`` (``F`` floats) and ``bias`` (a float), fitted on ``features(block)`` as the router applies them;
- ``gates``: ``{"keys": [L][H], "values": [L][H]}`` residual gates in [0, 1] per layer and KV head;
- ``levels`` (the router's ``levels()``) and ``heldout`` (the held-out evaluation), for the record.

The protocol only names the members training calls on top of :class:`Router` (``levels``, ``gates``,
``needs_attention``, which every router has). Shapes: ``G`` layers of the routed basis group, ``B``
batch, ``H`` KV heads, ``n`` tokens of the block, ``F`` features.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from kvweave.core.interfaces import RouteBlock
from kvweave.core.lazy import torch

#: the members of :class:`TrainableRouter`, in the order its docs list them
TRAINABLE_MEMBERS = ("feature_names", "features", "initial_weights")


@runtime_checkable
class TrainableRouter(Protocol):
    """A router whose token scores ``sigmoid(features(block) @ u + bias)`` ``kvweave train`` can fit."""

    def feature_names(self) -> tuple[str, ...]:
        """The names of the ``F`` features, in the order of the last axis of :meth:`features`."""
        ...

    def features(self, block: RouteBlock) -> torch.Tensor:
        """Features ``phi`` [G, B, H, n, F] (float) of every token of ``block``, exactly as the router's
        scores use them (a feature the block cannot provide is zeros)."""
        ...

    def initial_weights(self) -> tuple[Sequence[float], float]:
        """The untrained ``(u, bias)``: ``u`` F floats, ``bias`` a float. Training starts from them and
        compares the fitted weights against them on held-out text."""
        ...


def missing_members(router: Any) -> list[str]:
    """The :class:`TrainableRouter` members ``router`` lacks (empty: it implements the protocol)."""
    return [name for name in TRAINABLE_MEMBERS if not callable(getattr(router, name, None))]
