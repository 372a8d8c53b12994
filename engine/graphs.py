"""Greedy decoding with each block's decode steps replayed from one CUDA graph.

A decode step of a small batch is bound by the host: the model's ~15 launches a layer, the cache's update and the
kernel's launch planning take longer than the GPU's work (docs/kernels.md, "A decode step, broken down"). A CUDA graph
replays a step's kernels without the host, but only if every step launches the same kernels on the same addresses.
Between two flushes a kvweave cache's packed storage does not change, so what changes is the exact window, one token
longer each step: :meth:`kvweave.engine.exact.ExactTokens.make_static` keeps it in buffers of the block's capacity, each
step's token goes in at a device counter (``fill``), and the kernel that reads the packed storage in place (``lowbit``,
``fused``) reads the window's length from that counter. So a block is decoded as: one eager step (it builds and compiles what the
step needs), the capture of the next, then replays; the step that flushes (every ``block_tokens`` steps) runs eagerly,
as does any step where fewer than :data:`MIN_GRAPH_STEPS` remain before a flush. After a flush the next block is
captured at once: the kernel builds each layer's view of the new storage without a step
(:meth:`~kvweave.core.interfaces.AttentionKernel.prepare`), and the first block compiled every kernel a step launches
(the eager step cost as much as a capture: 74 ms at B = 1 on Llama-3-8B's shape).

A router that reads each layer's recent queries and the tokens' delimiter flags (``depthweave-kv``'s) has them kept in
place too (:meth:`kvweave.engine.observation.Observer.make_static`): the queries move on inside their tensors, a step's
flag goes in at the window's fill. The host's own counts (the window's, the observer's keys seen and flags noted) move
on after each replay (:func:`advance_static`), the only host state a decode step changes while no block is flushed.
Where no GPU is present the same static steps run without capture (what the tests compare with ``model.generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvweave.core.errors import CacheStateError
from kvweave.engine.observation import cache_kwargs
from kvweave.engine.views import layer_view

#: the least number of steps before the next flush for which a graph is captured (a capture costs about one eager step)
MIN_GRAPH_STEPS = 4


def graph_refusal(cache: Any) -> str | None:
    """Why ``cache``'s decode steps cannot be replayed from a CUDA graph (None: they can), naming what stands in the way."""
    engine = cache.engine
    name = f"pipeline '{engine.pipeline.name}'"
    kernel = engine.pipeline.slots["kernel"].use
    if not getattr(engine.kernel, "reads_window_fill", False):
        return (f"{name}: kernel '{kernel}' reads the exact window's length from its shape; CUDA graphs need a kernel that "
                "reads it from the device (kernel 'lowbit' or 'fused')")
    if engine.sliding:
        return f"{name}: the model has sliding-window layers, whose windows slide every step"
    if engine.rows is not None:
        return f"{name}: a left-padded batch is stored row by row; CUDA graphs decode rows without padding"
    if engine.energy is not None:
        return f"{name}: its keys record each step's query energy"
    if engine.accumulates:
        return f"{name}: its evictor accumulates each step's attention"
    if cache.shard is not None:
        return f"{name}: a tensor-parallel share of the heads"
    return None


def steps_before_flush(engine: Any) -> int:
    """Decode steps (one token each) the cache takes before the one that flushes a block."""
    settings = engine.settings
    held = max(window.exact_tokens for window in engine.windows)
    return max(0, settings.recent_window + settings.block_tokens - 1 - held)


def begin_static(engine: Any, steps: int) -> torch.Tensor:
    """Keep every layer's window for ``steps`` decode steps in place; returns the device's count of the tokens each holds
    (int32 [1], shared by the layers: every layer takes each step's token), which each step advances."""
    counts = {window.exact_tokens for window in engine.windows}
    if len(counts) != 1:
        raise CacheStateError(f"the layers' exact windows hold {sorted(counts)} tokens; CUDA graphs need one length")
    held = counts.pop()
    fill = torch.full((1,), held, dtype=torch.int32, device=engine.windows[0].exact.device)
    try:
        for window in engine.windows:
            window.exact.make_static(held + steps, fill)
        engine.observer.make_static(steps, held)
    except BaseException:
        end_static(engine)
        raise
    engine.attending.clear()
    return fill


def advance_static(engine: Any, steps: int = 1) -> None:
    """The host's count of every kept window moved on by ``steps`` (after replayed steps, which ran no Python)."""
    for window in engine.windows:
        window.exact.advance(steps)
    engine.observer.advance(steps)


def end_static(engine: Any) -> None:
    """Every window back to tensors of its own length (before a flush)."""
    for window in engine.windows:
        window.exact.end_static()
    engine.observer.end_static()
    engine.attending.clear()


class _Step:
    """One greedy decode step on fixed tensors: the next token's forward, its argmax written where the next step reads
    it and into the output at the step's index, every position moved on by one on the device."""

    def __init__(self, model: Any, cache: Any, first: torch.Tensor, steps: int) -> None:
        batch, device = first.shape[0], first.device
        position = cache.get_seq_length()
        self.model, self.cache = model, cache
        self.ids = first.reshape(batch, 1).to(torch.long).clone()
        self.position_ids = torch.full((batch, 1), position, dtype=torch.long, device=device)
        self.out = torch.zeros(batch, steps, dtype=torch.long, device=device)
        self.at = torch.zeros(1, dtype=torch.long, device=device)
        self.done = 0  # steps run (the host's count of ``at``)

    def __call__(self, fill: torch.Tensor | None) -> None:
        logits = self.model(input_ids=self.ids, position_ids=self.position_ids, use_cache=True, logits_to_keep=1,
                            **cache_kwargs(self.model, self.cache)).logits
        token = logits[:, -1].argmax(-1, keepdim=True)
        self.ids.copy_(token)
        self.out.index_copy_(1, self.at, token)
        self.at.add_(1)
        self.position_ids.add_(1)
        if fill is not None:
            fill.add_(1)


def graph_decode(model: Any, cache: Any, first: torch.Tensor, steps: int, *, capture: bool | None = None,
                 eos_token_id: int | list[int] | None = None, on_step: Callable[[], None] | None = None) -> torch.Tensor:
    """Greedy decoding of ``steps`` tokens after ``first`` [B] or [B, 1] (the token whose forward comes next; ``cache``
    holds every token before it): the new tokens [B, steps], the same as ``model.generate`` would decode greedily.
    ``capture``: replay each block's steps from a CUDA graph (None: where ``first`` is on a GPU); without, the same
    steps run eagerly. ``eos_token_id`` (one id or several): stop at the step by which every row produced one (a row's
    tokens after its own end are whatever the model decoded: :func:`ended_rows_padded` pads them as ``model.generate``
    does). ``on_step``: called after each step (e.g. to time it). Refused as :func:`graph_refusal` says, and a capture
    of a kernel's torch twin or of CPU tensors."""
    refusal = graph_refusal(cache)
    if refusal is not None:
        raise CacheStateError(f"CUDA graph decoding: {refusal}")
    if steps < 0:
        raise ValueError(f"graph_decode: steps must be >= 0, got {steps}")
    capture = first.is_cuda if capture is None else capture
    if capture and getattr(cache.engine.kernel, "backend", None) == "torch":
        raise CacheStateError(f"CUDA graph decoding: pipeline '{cache.engine.pipeline.name}' runs its kernel's torch twin "
                              "(backend 'torch'), which is no capture's; use backend 'auto' or 'triton'")
    if capture and not first.is_cuda:
        raise CacheStateError("CUDA graph decoding captures graphs on a GPU; the tokens are on the CPU (capture=False runs the steps eagerly)")
    engine, step = cache.engine, _Step(model, cache, first, steps)
    stop = _Ends(step, eos_token_id, on_step)
    captured = False  # a block captured in this call: later blocks (each after a flush) are captured at once
    with torch.inference_mode():
        while step.done < steps and not stop.all_ended:
            free = min(steps_before_flush(engine), steps - step.done)
            if free < MIN_GRAPH_STEPS:
                step(None)
                stop.after_step()
            else:
                _block(engine, step, free, capture, stop, warm=captured)
                captured = captured or capture
    return step.out[:, :step.done]


class _Ends:
    """After each step: ``on_step``, then whether every row has produced an end-of-sequence id (one read of the device a
    step, only where ``eos_token_id`` is given: decoding stops at that step, as ``model.generate`` does)."""

    def __init__(self, step: _Step, eos_token_id: int | list[int] | None, on_step: Callable[[], None] | None) -> None:
        self.step, self.on_step = step, on_step
        device = step.out.device
        self.ends = None if eos_token_id is None else torch.tensor(eos_token_id, device=device).reshape(-1)
        self.ended = None if self.ends is None else torch.isin(step.ids[:, 0], self.ends)  # the token before the first step
        self.all_ended = self.ended is not None and bool(self.ended.all())

    def after_step(self) -> bool:
        self.step.done += 1
        if self.on_step is not None:
            self.on_step()
        if self.ended is not None:
            self.ended |= torch.isin(self.step.out[:, self.step.done - 1], self.ends)
            self.all_ended = bool(self.ended.all())
        return self.all_ended


def _block(engine: Any, step: _Step, free: int, capture: bool, stop: _Ends, warm: bool = False) -> None:
    """Up to ``free`` steps with the windows kept in place, replayed from one graph: the first run eagerly unless
    ``warm`` (an earlier block compiled what a step launches; the kernel's views of the storage, new since a flush, are
    built without a step: :meth:`~kvweave.core.interfaces.AttentionKernel.prepare`, which finds them built otherwise)."""
    fill = begin_static(engine, free)
    graph = None
    eager = not (warm and capture)
    try:
        if eager:
            step(fill)  # builds the kernels' views and compiles what the graph will replay
            advance_static(engine)
            if stop.after_step():
                return
        else:  # a flush comes after its step's attention: the views of the new storage, built here
            for layer in range(engine.shape.num_layers):
                engine.kernel.prepare(layer_view(engine, layer), fill.device)
        if capture and free > 1:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step(fill)  # recorded, not run
        for _ in range(free - 1 if eager else free):
            if graph is not None:
                graph.replay()
            else:
                step(fill)
            advance_static(engine)
            if stop.after_step():
                return
    finally:
        end_static(engine)
        del graph


def ended_rows_padded(tokens: torch.Tensor, eos_token_id: int | list[int] | None, pad_token_id: int | None) -> torch.Tensor:
    """``tokens`` [B, n] as ``model.generate`` returns them: each row's tokens after its first end-of-sequence id
    replaced by ``pad_token_id`` (by that end id where there is none), and the columns after the last row's end left out."""
    if eos_token_id is None or tokens.shape[1] == 0:
        return tokens
    ends = torch.isin(tokens, torch.tensor(eos_token_id, device=tokens.device).reshape(-1))
    after = (ends.cumsum(-1) - ends.long()) > 0  # past the row's first end
    if not bool(ends.any(-1).all()):
        keep = tokens.shape[1]
    else:
        keep = int(ends.float().argmax(-1).max()) + 1
    fill = pad_token_id if pad_token_id is not None else (eos_token_id if isinstance(eos_token_id, int) else eos_token_id[0])
    return tokens.masked_fill(after, fill)[:, :keep]
