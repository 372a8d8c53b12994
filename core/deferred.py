"""Checks of a flushed block that read the host once a forward instead of once each.

Refusing a block (non-finite values, a magnitude a quantizer's float16 fields cannot hold) needs a flag computed on the
device read on the host. Read where it is computed, each stops the host until the GPU has run everything queued
before it, and the GPU then waits for the host to queue the next work: a prompt's flush made about nine such reads a
layer. While a :class:`DeferredChecks` collects (``with checks.collecting():``, what the engine does around a
flush), :func:`defer` keeps each flag with the function that raises its error, and :meth:`DeferredChecks.resolve`
reads them all at once (the engine does after the forward's last flush, before the next forward stores anything, and
before any other error of a flush propagates): the first failed check raises, as it would have raised at once.
Outside a collector :func:`defer` returns False and the caller checks at once.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator

from kvweave.core.lazy import torch

_ACTIVE: contextvars.ContextVar[DeferredChecks | None] = contextvars.ContextVar("kvweave_deferred_checks", default=None)


class DeferredChecks:
    """Failure flags (bool device scalars) kept with the functions that raise their errors, read together."""

    def __init__(self) -> None:
        self.pending: list[tuple[torch.Tensor, Callable[[], None]]] = []

    @contextlib.contextmanager
    def collecting(self, active: bool = True) -> Iterator[DeferredChecks]:
        """Checks made inside defer to this collector (while ``active``); an error raised inside resolves the pending
        ones first, so that a failed check names the cause of what followed it."""
        if not active:
            yield self
            return
        token = _ACTIVE.set(self)
        try:
            yield self
        except BaseException:
            self.resolve()
            raise
        finally:
            _ACTIVE.reset(token)

    def add(self, failed: torch.Tensor, fail: Callable[[], None]) -> None:
        self.pending.append((failed.reshape(()), fail))

    def resolve(self) -> None:
        """Read every pending flag in one host read; call the first failed check's function (it raises)."""
        pending, self.pending = self.pending, []
        if not pending:
            return
        flags = torch.stack([flag.to(pending[0][0].device) for flag, _ in pending])
        if bool(flags.any()):
            pending[int(flags.to(torch.uint8).argmax())][1]()
            raise RuntimeError("a deferred check failed but its function raised nothing")

    def clear(self) -> None:
        self.pending = []


def check(failed: torch.Tensor, fail: Callable[[], None]) -> None:
    """:func:`defer` the check, or where none collects read ``failed`` now and call ``fail`` (which raises)."""
    if not defer(failed, fail) and bool(failed):
        fail()


def defer(failed: torch.Tensor, fail: Callable[[], None]) -> bool:
    """Hand the check ``failed`` (a bool scalar on any device) and the function raising its error to the collecting
    :class:`DeferredChecks`; False where none collects (the caller checks at once)."""
    checks = _ACTIVE.get()
    if checks is None:
        return False
    checks.add(failed, fail)
    return True
