"""A block captured right after a flush: the kernel's views of the new storage are built before the capture, so the
captured step reads nothing from the device (a capture fails on any such read)."""

from __future__ import annotations

import traceback
from collections import Counter

import pytest
import torch
import torch.overrides

from conftest import tiny_llama
from kvweave.engine import cache_kwargs
from kvweave.engine.graphs import _Step, advance_static, begin_static, end_static, steps_before_flush
from kvweave.engine.views import layer_view
from test_graphs import _flagship, _frontier_cache

#: torch calls that read a tensor on the host (each one a synchronization on a GPU)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "equal", "nonzero", "any", "all"}


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts host reads by where they were made, leaving out the kernel's CPU twin (``twins``: a GPU runs the Triton
    kernel)."""

    def __init__(self, twins: tuple[str, ...] = ("torch_lowbit_decode",)) -> None:
        super().__init__()
        self.sites: Counter = Counter()
        self.twins = twins

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            frames = [f for f in traceback.extract_stack(limit=16)[:-1] if "kvweave" in f.filename or "/engine/" in f.filename
                      or "/plugins/" in f.filename or "/kernels/" in f.filename]
            if not any(f.name in self.twins for f in frames):
                self.sites[(name, frames[-1].name if frames else "?")] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.interpreter
@pytest.mark.parametrize("prepared", [True, False])
def test_after_a_flush_the_prepared_views_leave_a_static_step_nothing_to_read(prepared):
    net = tiny_llama(torch.float32, hidden=256, layers=2)
    net.generation_config.eos_token_id = None
    ids = torch.randint(1, 128, (2, 90), generator=torch.Generator().manual_seed(1))
    cache = _frontier_cache(net, ids)
    with torch.no_grad():
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 90:]
    engine = cache.engine
    for layer_window in engine.windows:  # the window's put kernel (in the interpreter), as a GPU runs it
        layer_window.exact.fused = True
    step = _Step(net, cache, first, 200)
    flushes = cache.engine.stores[0]["keys"].flushes
    with torch.inference_mode():
        for _ in range(steps_before_flush(engine) + 1):  # up to and with the step that flushes
            step(None)
    assert cache.engine.stores[0]["keys"].flushes == flushes + 1
    with torch.inference_mode():
        fill = begin_static(engine, 8)
        try:
            if prepared:
                for layer in range(engine.shape.num_layers):
                    engine.kernel.prepare(layer_view(engine, layer), fill.device)
            with _HostReads() as reads:
                step(fill)
        finally:
            end_static(engine)
    if prepared:
        assert not reads.sites, dict(reads.sites)
    else:  # without, the step builds the views itself (the check above could not pass unless prepare builds them)
        assert any(site == "hidden_prefix" for _, site in reads.sites), dict(reads.sites)


@pytest.mark.parametrize("prepared", [True, False])
def test_depthweave_kv_steps_kept_in_place_read_nothing_after_the_first(prepared):
    """The flagship (the fused kernel, a router that records each step's queries and delimiter flags): the steps of a
    block after its first, and the block right after a flush with its views prepared, read nothing from the device
    outside the kernel's twin. It read the sketch basis's layer count for every layer and step; unprepared, the block
    after a flush builds its segment table from the device (the check above could not pass unless prepare builds it)."""
    net, _, cache, first = _flagship()
    engine = cache.engine
    step = _Step(net, cache, first, 200)
    with torch.inference_mode():
        fill = begin_static(engine, 3)
        try:
            step(fill)  # a block's first step: eager on a GPU too
            advance_static(engine)
            with _HostReads(("torch_decode",)) as within:
                step(fill)
                advance_static(engine)
        finally:
            end_static(engine)
        for _ in range(steps_before_flush(engine) + 1):  # up to and with the step that flushes
            step(None)
        fill = begin_static(engine, 8)
        try:
            if prepared:
                for layer in range(engine.shape.num_layers):
                    engine.kernel.prepare(layer_view(engine, layer), fill.device)
            with _HostReads(("torch_decode",)) as after_flush:
                step(fill)
        finally:
            end_static(engine)
    assert not within.sites, dict(within.sites)
    if prepared:
        assert not after_flush.sites, dict(after_flush.sites)
    else:
        assert any(site == "_segments" for _, site in after_flush.sites), dict(after_flush.sites)
