"""A prompt's flushes issued a basis group behind the model's forward, on a CUDA stream of their own.

A group's flush stores its block once the last of its layers has attended. Issued at that moment on the forward's
stream, the flush's first host read (the sketch's ``eigh``, the rank counts) waits for every layer queued before it,
and while the host then issues the flush's few hundred small operations the GPU has nothing of the forward to run: on
Llama-3-8B's shape at 32K tokens depthweave-kv's eight flushes added 0.29 s to a first token of 1.38 s.

While a :class:`FlushOverlap` overlaps a forward, a group's flush is queued with an event of the forward's stream and
issued when the next group asks for its own flush, on a side stream that waits for that event only. By then the
next group's layers are queued on the forward's stream, so the GPU runs them while the host issues the flush and
while the flush's reads wait for the side stream alone. The forward's stream waits for each flush before the work the
host queues after it: memory a flush frees goes back to the forward's stream's pool at once, and nothing queued
after the flush may reuse it before the flush has read it. The last flushing group's request issues every queued flush,
and the forward's stream waits for them all.

The flushes run in the order they would have run, each over the same tokens: a layer's attention reads only its own
layer's storage, and a forward's flushes change only their own group's layers (the probes' shares move after the last
one), so the stored bytes are those of flushes issued at once (tested bit for bit, in the same order on a CPU).

It overlaps only a prompt into an empty cache on a GPU, through a forward that attends (a forward's ``update`` with
``materialize``): a decode step's flush (and a CUDA graph's) stays where it was. ``KVWEAVE_FLUSH_OVERLAP=0`` turns it
off; the side stream runs at the higher priority (``KVWEAVE_FLUSH_PRIORITY=0``: the forward's); :attr:`FlushOverlap.forced`
runs the queue on one stream (``"queue"``: what tests off a GPU compare).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from kvweave.core.environment import env_setting, env_switch

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine

#: a prompt's flushes go behind the forward on a side stream (``KVWEAVE_FLUSH_OVERLAP=0``: each at once)
OVERLAP = env_switch("KVWEAVE_FLUSH_OVERLAP")
#: 1: the side stream at a higher priority than the forward's (its blocks scheduled first where both wait for the GPU:
#: the host's reads inside a flush wait less; 0.06-0.13 s off depthweave-kv's first token at 32K on an H100)
PRIORITY = env_setting("KVWEAVE_FLUSH_PRIORITY", 1, (0, 1))
#: flushes queued behind the forward: one group's (its flush waits for the next group's layers to be queued)
LAG = 1
#: the side streams, one per device (made once: a stream is a device resource, not a tensor)
_STREAMS: dict[int, Any] = {}


def side_stream(device: torch.device) -> Any:
    """The side stream of CUDA ``device`` the prompt's flushes run on."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=-PRIORITY)
    return _STREAMS[index]


class FlushOverlap:
    """The engine's queue of flushes for the forward in progress (one per engine)."""

    #: None: as the environment and the device say; "queue": queued on the current stream, also off a GPU (tests);
    #: "stream": on the side stream (a GPU); "off": never. Set on an engine's overlap, or on the class for engines made
    #: later (a left-padded batch's rows)
    forced: str | None = None

    def __init__(self, engine: CompressionEngine) -> None:
        self.engine = engine
        #: this forward's way: None (each flush at once), "queue" or "stream"
        self.mode: str | None = None
        #: (group, the event of the forward's stream after its layers' attention; None: issued on the current stream)
        self.queued: list[tuple[int, Any]] = []
        #: queued flushes issued since the engine was made (what tests read)
        self.issued = 0

    def start_forward(self, keys: torch.Tensor, materialize: bool) -> None:
        """A forward's first layer arrives with ``keys`` [B, H, q, D]: issue what an interrupted forward left queued,
        then choose this forward's way (before its tokens enter the windows)."""
        self.settle()
        engine = self.engine
        window = engine.windows[0]
        empty = window.exact.shape() is None and window.compressed_tokens == 0
        fills = keys.shape[-2] >= engine.settings.recent_window + engine.settings.block_tokens
        wanted = self.forced if self.forced is not None else ("stream" if OVERLAP and keys.is_cuda else "off")
        self.mode = wanted if wanted != "off" and materialize and empty and fills and engine.settings.compress else None

    def request(self, group_index: int) -> None:
        """The group asks for its flush: at once, or queued behind the forward (the last flushing group's request
        issues every queued flush)."""
        if self.mode is None:
            self.engine._flush(group_index)
            return
        device = self.engine.windows[self.engine.groups[group_index][0]].exact.device
        event = None
        if self.mode == "stream" and device is not None and device.type == "cuda":  # the group's layers' GPU
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
        self.queued.append((group_index, event))
        self._issue_queued(0 if group_index == self.engine.last_flushing else LAG)

    def settle(self) -> None:
        """Issue every queued flush (the forward's flushes are done)."""
        self._issue_queued(0)

    def _issue_queued(self, keep: int) -> None:
        """Issue the queued flushes, oldest first, until ``keep`` are left (0: the forward's flushes are done). A flush
        that raises drops the queue: the groups after it keep their tokens in their windows, as where the forward
        stops at the flush that raised."""
        try:
            while len(self.queued) > keep:
                self._issue(*self.queued.pop(0))
        except BaseException:
            self.queued, self.mode = [], None
            raise
        if keep == 0:
            self.mode = None

    def clear(self) -> None:
        """Forget the queue (the engine's reset)."""
        self.queued, self.mode = [], None

    def _issue(self, group_index: int, event: Any) -> None:
        self.issued += 1
        if event is None:
            self.engine._flush(group_index)
            return
        device = self.engine.windows[self.engine.groups[group_index][0]].exact.device
        side, main = side_stream(device), torch.cuda.current_stream(device)
        side.wait_event(event)
        try:
            with torch.cuda.stream(side):
                self.engine._flush(group_index)
        finally:
            main.wait_stream(side)  # what the host queues next runs after the flush (the memory it freed, its bytes)
