"""A forward's flush checks read the host once (``kvweave.core.deferred``): on a GPU (``defer_checks``, forced here on a
CPU) a prompt's flushes of the sinks pipeline make no host read until the forward's last flush resolves them all; a
failed check still raises its own error from that forward; fixed residual ranks give the same entries as ranks read
from the device."""

from __future__ import annotations

import pytest
import torch
import torch.overrides

from kvweave.core.deferred import DeferredChecks, defer
from kvweave.core.errors import CacheStateError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.residuals import encode_residuals
from kvweave.plugins.quantizers._scales import check_magnitude
from kvweave.plugins.quantizers.passthrough import NoQuantizer

from conftest import tiny_llama

HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "unique", "equal", "nonzero"}  # a value or a size from the device


class HostReads(torch.overrides.TorchFunctionMode):
    """Counts the torch calls that read a tensor's values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in HOST_READS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def test_a_prompts_flushes_read_the_host_once_when_deferred(monkeypatch):
    model = tiny_llama(torch.float32, hidden=256, layers=3)  # head_dim 64
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    reads = {}
    for defer_checks in (False, True):
        cache = build_cache(load_pipeline("l-qa35v3", "benchmarks/lean_sweep.toml"), model)
        cache.engine.defer_checks = defer_checks
        spy = HostReads()
        for name in ("_flush_block", "_update"):  # a layer's update (its int8 window) and its flush
            def counted(*args, method=getattr(cache.engine, name), spy=spy):
                with spy:
                    return method(*args)

            object.__setattr__(cache.engine, name, counted)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        reads[defer_checks] = spy.count
        assert cache.engine.windows[0].compressed_tokens == 128 and not cache.engine.deferred.pending
    # each layer: its window's range checks, its finite check and each quantizer's range check
    assert reads[True] == 0 and reads[False] >= 3 * 5


def test_a_prompt_beyond_the_int8_windows_range_is_refused_by_the_forward():
    model = tiny_llama(torch.float32, hidden=256, layers=3)
    cache = build_cache(load_pipeline("l-qa35v3", "benchmarks/lean_sweep.toml"), model)
    cache.engine.defer_checks = True
    with torch.no_grad():
        model.model.layers[1].self_attn.k_proj.weight.mul_(1e9)  # layer 1's keys beyond 127 x 65504
        with pytest.raises(ValueError, match="window_storage = 'int8': a token's largest magnitude .* is beyond"):
            model(input_ids=torch.randint(1, 128, (1, 40)), use_cache=True, **cache_kwargs(model, cache))
    assert not cache.engine.deferred.pending


def test_a_deferred_check_raises_its_own_error_from_the_forward():
    cache = build_cache("int4", tiny_llama(torch.float32, layers=3))  # one-layer groups, flushed by update
    cache.engine.defer_checks = True
    keys = torch.randn(1, 2, 300, 16)
    values = keys.clone()
    values[0, 1, 40, 3] = float("nan")
    cache.update(keys, keys, 0)
    cache.update(keys, values, 1)  # deferred: the forward's last group has not flushed yet
    assert len(cache.engine.deferred.pending) > 0
    with pytest.raises(CacheStateError, match=r"layer 1 sent non-finite values \(first at batch row 0, KV head 1, token 40\)"):
        cache.update(keys, keys, 2)


def test_checks_outside_a_collector_raise_at_once_and_inside_wait_for_resolve():
    with pytest.raises(ValueError, match="^q: largest magnitude 70000 is beyond the limit 65504 "):
        check_magnitude("q", torch.tensor([1.0, 7e4]), 65504.0, "float16")
    checks = DeferredChecks()
    with checks.collecting():
        check_magnitude("q", torch.tensor([1.0, 2.0]), 65504.0, "float16")
        check_magnitude("q", torch.tensor([1.0, 7e4]), 65504.0, "float16")
        assert defer(torch.tensor(True), lambda: pytest.fail("a later failure raised before the first"))
    assert len(checks.pending) == 3
    with pytest.raises(ValueError, match="^q: largest magnitude 70000 is beyond"):
        checks.resolve()
    assert not checks.pending
    checks.resolve()  # nothing pending: nothing raised


@pytest.mark.parametrize("runs", [((0, 2, 64), (4, 5, 8), (6, 8, 8), (9, 10, 64)), (), ((0, 10, 16),)])
def test_fixed_ranks_give_the_entries_that_ranks_on_the_device_give(runs):
    quantizer = NoQuantizer(dtype="float16")
    missing = torch.randn(2, 3, 10, 64)
    per_token = torch.zeros(10, dtype=torch.long)
    for start, stop, rank in runs:
        per_token[start:stop] = rank
    by_device = encode_residuals(missing, per_token.expand(2, 3, 10), quantizer)
    by_host = encode_residuals(missing, runs, quantizer)
    assert by_device.keys() == by_host.keys() == {rank for _, _, rank in runs}
    for rank, fields in by_device.items():
        assert fields.keys() == by_host[rank].keys()
        for name, tensor in fields.items():
            assert torch.equal(tensor, by_host[rank][name]), (rank, name)
    with pytest.raises(ValueError, match="reach outside a block of 10 tokens"):
        encode_residuals(missing, ((8, 11, 64),), quantizer)


@pytest.mark.parametrize("runs", [((0, 3, 7),), ((2, 4, 64), (3, 6, 64)), ((0, 0, 64),), ((0, 400, 64),)])
def test_a_router_giving_fixed_ranks_it_cannot_is_refused(monkeypatch, runs):
    from kvweave.core.errors import ComponentError
    from kvweave.plugins.routers.sinks import SinkRouter

    monkeypatch.setattr(SinkRouter, "fixed_ranks", lambda self, kind, first, tokens: runs)
    model = tiny_llama(torch.float32, hidden=256, layers=3)
    cache = build_cache(load_pipeline("l-qa35v3", "benchmarks/lean_sweep.toml"), model)
    with torch.no_grad(), pytest.raises(ComponentError, match=r"router 'sinks' fixed ranks .* expected runs \(start, stop, rank\)"):
        model(input_ids=torch.randint(1, 128, (1, 150)), use_cache=True, **cache_kwargs(model, cache))
