"""A prompt's flushes queued a basis group behind the forward (``kvweave.engine.overlap``): on a CPU in the same order
on one stream (``forced = "queue"``), bit for bit what flushes issued at once store; on a GPU on a side stream."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ComponentError
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.overlap import FlushOverlap

from conftest import tiny_llama, write_registry
from test_graphs import _depthweave_stored, _Vocabulary

PROMPT = 600  # eighteen blocks of 32 tokens leave the 32-token window at the prompt's flushes
STORED = (PROMPT - 32) // 32 * 32
#: depthweave-kv read by the reference path (the fused kernel takes head_dim 64 and up, slow in Triton's interpreter),
#: asked for 3x so that a tiny model's blocks take routed residuals
DEPTHWEAVE = "o-dw"
REGISTRY = """
[pipelines.o-dw]
extends = "depthweave-kv-reference-kernel"
recent_window = 32

[pipelines.o-dw.router]
target_reduction = 3.0
"""


@pytest.fixture(scope="module")
def twelve_layers():
    """A random bfloat16 12-layer Llama, head_dim 32: three 4-layer windows of depthweave-kv."""
    net = tiny_llama(torch.bfloat16, layers=12, hidden=128)
    net.generation_config.eos_token_id = None
    return net


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    """The built-in registry with :data:`DEPTHWEAVE`."""
    return load_registry(write_registry(tmp_path_factory.mktemp("overlap"), "overlap", REGISTRY))


def _generate(net, pipeline, forced: str, steps: int = 40, ids: torch.Tensor | None = None):
    cache = build_cache(pipeline, net, tokenizer=_Vocabulary())
    cache.engine.overlap.forced = forced
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1)) if ids is None else ids
    with torch.no_grad():
        out = net.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, **cache_kwargs(net, cache))
    return cache, out[:, PROMPT:]


def _reconstructed(cache) -> list[torch.Tensor]:
    engine = cache.engine
    return [engine.materialize(layer, kind) for layer in range(engine.shape.num_layers) for kind in ("keys", "values")]


@pytest.mark.parametrize("pipeline", [DEPTHWEAVE, "snapkv", "kivi-2", "prerope-qa35v3", "int4-outliers", "minicache"])
def test_queued_flushes_store_what_flushes_at_once_store(twelve_layers, registry, pipeline):
    """Forty tokens after a prompt of eighteen blocks: the same tokens, the same stored bytes, the same reconstructed keys
    and values, bit for bit, with the prompt's flushes queued a group behind (the decode steps' flushes at once)."""
    at_once, expected = _generate(twelve_layers, registry.resolve(pipeline), "off")
    queued, tokens = _generate(twelve_layers, registry.resolve(pipeline), "queue")
    assert queued.engine.overlap.issued > 0 and at_once.engine.overlap.issued == 0
    assert torch.equal(tokens, expected)
    assert queued.memory_breakdown() == at_once.memory_breakdown()
    for got, want in zip(_reconstructed(queued), _reconstructed(at_once)):
        assert torch.equal(got, want)
    if pipeline == DEPTHWEAVE:
        for got, want in zip(_depthweave_stored(queued), _depthweave_stored(at_once), strict=True):
            assert torch.equal(got, want)


def test_a_groups_flush_waits_for_the_next_groups_layers(twelve_layers, registry, monkeypatch):
    """Group 0's flush is issued when layer 7 (group 1's last) has attended, groups 1 and 2 at layer 11; a decode
    step's flushes at once."""
    cache = build_cache(registry.resolve(DEPTHWEAVE), twelve_layers, tokenizer=_Vocabulary())
    engine = cache.engine
    engine.overlap.forced = "queue"
    seen: list[int] = []
    log: list[tuple[int, int]] = []  # (group flushed, the last layer that had attended)
    attended, flush = engine.after_attention, engine._flush
    monkeypatch.setattr(engine, "after_attention", lambda layer: seen.append(layer) or attended(layer))
    monkeypatch.setattr(engine, "_flush", lambda group: log.append((group, seen[-1])) or flush(group))
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        twelve_layers(input_ids=ids, use_cache=True, **cache_kwargs(twelve_layers, cache))
    assert log == [(0, 7), (1, 11), (2, 11)]
    assert engine.overlap.queued == [] and engine.overlap.mode is None
    assert all(window.compressed_tokens == STORED for window in engine.windows)
    log.clear()
    with torch.no_grad():  # 600 + 1 tokens: no block leaves the window, each group's flush is asked for at once
        twelve_layers(input_ids=ids[:, :1], use_cache=True, **cache_kwargs(twelve_layers, cache))
    assert log == [(0, 3), (1, 7), (2, 11)]


def test_a_flush_that_raises_drops_the_queue(twelve_layers, registry, monkeypatch):
    """The error of a queued flush reaches the forward; the groups after it keep their tokens in their windows and
    the next prompt into a reset cache queues again."""
    cache = build_cache(registry.resolve(DEPTHWEAVE), twelve_layers, tokenizer=_Vocabulary())
    engine = cache.engine
    engine.overlap.forced = "queue"
    flush = engine._flush

    def failing(group):
        if group == 1:
            raise ComponentError("group 1 refused")
        flush(group)

    monkeypatch.setattr(engine, "_flush", failing)
    ids = torch.randint(1, 128, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), pytest.raises(ComponentError, match="group 1 refused"):
        twelve_layers(input_ids=ids, use_cache=True, **cache_kwargs(twelve_layers, cache))
    assert engine.overlap.queued == [] and engine.overlap.mode is None
    assert [engine.windows[layer].compressed_tokens for layer in (0, 4, 8)] == [STORED, 0, 0]
    assert engine.windows[8].exact_tokens == PROMPT
    monkeypatch.setattr(engine, "_flush", flush)
    cache.reset()
    with torch.no_grad():
        twelve_layers(input_ids=ids, use_cache=True, **cache_kwargs(twelve_layers, cache))
    assert all(window.compressed_tokens == STORED for window in engine.windows)


def test_the_overlap_applies_to_a_prompt_into_an_empty_cache_only(twelve_layers, registry):
    """Not a forward shorter than a block past the window, not one into a cache that holds tokens, not off a GPU
    unless forced, and ``off`` forced never."""
    cache = build_cache(registry.resolve(DEPTHWEAVE), twelve_layers, tokenizer=_Vocabulary())
    overlap: FlushOverlap = cache.engine.overlap
    keys = torch.zeros(1, 2, PROMPT, 16)
    overlap.start_forward(keys, materialize=True)
    assert overlap.mode is None  # a CPU, not forced
    overlap.forced = "queue"
    overlap.start_forward(keys, materialize=True)
    assert overlap.mode == "queue"
    overlap.start_forward(keys, materialize=False)  # filling without attention (synthetic, ingest)
    assert overlap.mode is None
    overlap.start_forward(keys[..., :63, :], materialize=True)  # 32 + 32 tokens fill the first block
    assert overlap.mode is None
    overlap.start_forward(keys[..., :64, :], materialize=True)
    assert overlap.mode == "queue"
    overlap.forced = "off"
    overlap.start_forward(keys, materialize=True)
    assert overlap.mode is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the side stream is a CUDA stream")
@pytest.mark.parametrize("pipeline", ["depthweave-kv", "prerope-qa35v3-lowbit"])
def test_flushes_on_the_side_stream_store_what_flushes_at_once_store(pipeline):
    """On a GPU (bfloat16, head_dim 128, 8 layers) the prompt's flushes go to the side stream and the cache decodes the
    same tokens from the same bytes; the reconstructed keys and values agree to float rounding."""
    from test_graphs_gpu import _gpu_llama

    net, ids = _gpu_llama(128, 8)
    ids = ids[:1]

    def run(forced):
        cache = build_cache(pipeline, net, tokenizer=_Vocabulary())
        cache.engine.overlap.forced = forced
        with torch.no_grad():
            out = net.generate(input_ids=ids, max_new_tokens=30, do_sample=False, **cache_kwargs(net, cache))
        torch.cuda.synchronize()
        return cache, out[:, ids.shape[-1]:]

    at_once, expected = run("off")
    overlapped, tokens = run(None)  # the default on a GPU
    assert overlapped.engine.overlap.issued > 0 and at_once.engine.overlap.issued == 0
    assert torch.equal(tokens, expected)
    assert overlapped.memory_breakdown() == at_once.memory_breakdown()
    for got, want in zip(_reconstructed(overlapped), _reconstructed(at_once)):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("variable, value", [("KVWEAVE_FLUSH_OVERLAP", "sometimes"), ("KVWEAVE_FLUSH_PRIORITY", "2")])
def test_a_wrong_setting_is_refused_by_name(variable, value):
    """The overlap's environment settings are read at import; a value they do not take is refused naming the
    variable."""
    import os
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import kvweave.engine.overlap"], capture_output=True, text=True,
                          env={**os.environ, variable: value})
    assert done.returncode != 0
    assert f"{variable}={value!r}" in done.stderr


def test_a_left_padded_batchs_rows_queue_their_flushes_alike(twelve_layers, registry, monkeypatch):
    """Each row of a left-padded batch is stored by an engine of its own, made at the first forward: with the class's
    setting those engines queue too, and the batch decodes the same tokens from the same bytes as flushes at once."""
    ids = torch.randint(1, 128, (2, PROMPT), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[0, :40] = 0

    def run(forced):
        monkeypatch.setattr(FlushOverlap, "forced", forced)
        cache = build_cache(registry.resolve(DEPTHWEAVE), twelve_layers, tokenizer=_Vocabulary())
        with torch.no_grad():
            out = twelve_layers.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                         pad_token_id=0, **cache_kwargs(twelve_layers, cache))
        return cache, out[:, PROMPT:]

    at_once, expected = run("off")
    queued, tokens = run("queue")
    assert queued.engine.rows is not None and all(engine.overlap.issued > 0 for engine in queued.engine.rows.engines)
    assert all(engine.overlap.issued == 0 for engine in at_once.engine.rows.engines)
    assert torch.equal(tokens, expected)
    assert queued.memory_bytes() == at_once.memory_bytes()
