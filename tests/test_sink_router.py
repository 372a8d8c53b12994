"""The ``sinks`` router: the first positions of a sequence restored to float16 precision through a full-rank
residual, every other token left to its codes, the residual's bytes counted."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs

from conftest import tiny_llama, write_registry

REGISTRY = """
[pipelines.s-plain]
extends = "prerope-qa3v2"
recent_window = 16

[pipelines.s-sinks]
extends = "s-plain"
[pipelines.s-sinks.router]
use = "sinks"
sink_tokens = 3
rank = 64
[pipelines.s-sinks.residual_quantizer]
use = "none"
dtype = "float16"

[pipelines.s-sinks-values]
extends = "s-sinks"
[pipelines.s-sinks-values.router]
kinds = "values"
"""


def _fill(model, name, registry, ids):
    cache = build_cache(load_pipeline(name, registry), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    return cache


def test_sink_tokens_come_back_exact_and_the_rest_as_coded(tmp_path):
    model = tiny_llama(torch.float32, hidden=256)  # head_dim 64
    registry = write_registry(tmp_path, "sinks", REGISTRY)
    ids = torch.randint(1, 128, (2, 150))
    caches = {name: _fill(model, name, registry, ids) for name in ("full", "s-plain", "s-sinks", "s-sinks-values")}
    for layer in range(model.config.num_hidden_layers):
        for kind in ("keys", "values"):
            exact = caches["full"].engine.materialize(layer, kind)
            plain = caches["s-plain"].engine.materialize(layer, kind)
            sinks = caches["s-sinks"].engine.materialize(layer, kind)
            error = lambda x: (x - exact).norm(dim=-1) / exact.norm(dim=-1)  # noqa: E731  [B, H, T]
            assert bool((error(sinks)[..., :3] < 1e-3).all()), (layer, kind)
            assert bool((error(plain)[..., :3] > 1e-2).all()), (layer, kind)
            assert torch.equal(sinks[..., 3:, :], plain[..., 3:, :])  # every other token: its codes alone
        # values only: the keys of the sinks stay as coded
        keys = caches["s-sinks-values"].engine.materialize(layer, "keys")
        assert torch.equal(keys, caches["s-plain"].engine.materialize(layer, "keys"))
    parts = {name: cache.memory_breakdown() for name, cache in caches.items()}
    assert parts["s-plain"]["residuals"] == 0
    layers, rows, heads = model.config.num_hidden_layers, 2, 2
    # per sink, layer, row, head and kind: 64 float16 channels; per layer and kind the list's bits up to its last entry
    # (one int32 word a row and head: the sinks are the first tokens) and its one block's int32 start; no row or token
    # index an entry
    assert parts["s-sinks"]["residuals"] == layers * 2 * (rows * heads * (3 * 64 * 2 + 4) + 4)
    assert parts["s-sinks-values"]["residuals"] == parts["s-sinks"]["residuals"] // 2


def test_a_rank_beyond_the_head_dim_is_refused(tmp_path):
    registry = write_registry(tmp_path, "sinks", REGISTRY + "\n[pipelines.s-wide]\nextends = \"s-sinks\"\n[pipelines.s-wide.router]\nrank = 128\n")
    with pytest.raises(ModelError, match="rank 128 exceeds the model's head_dim 64"):
        build_cache(load_pipeline("s-wide", registry), tiny_llama(torch.float32, hidden=256))


@pytest.mark.parametrize("name", ["s-sinks", "s-sinks-values"])
def test_blocks_past_the_sinks_are_not_reconstructed_and_store_the_same(tmp_path, monkeypatch, name):
    """A block whose positions all lie past the sinks gets no residual: its reconstruction is skipped; the prompt's
    block is reconstructed for its first group of tokens only, which hold the sinks, and their ranks are fixed
    (no host read of ranks). The storage after a prefill and decode-time flushes is the same as when every block is
    reconstructed whole and routed by ``assign``."""
    from kvweave.plugins.routers.sinks import SinkRouter

    model = tiny_llama(torch.float32, hidden=256)
    model.generation_config.eos_token_id = None
    registry = write_registry(tmp_path, "sinks", REGISTRY)
    ids = torch.randint(1, 128, (2, 210), generator=torch.Generator().manual_seed(3))  # a prompt block of 192 tokens

    def run():
        cache = build_cache(load_pipeline(name, registry), model)
        with torch.no_grad():
            model.generate(input_ids=ids, max_new_tokens=80, do_sample=False, **cache_kwargs(model, cache))
        return cache

    calls, decoded, fixed = [], [], []  # each block routed by assign: its first position and the tokens reconstructed
    assign, fixed_ranks = SinkRouter.assign, SinkRouter.fixed_ranks
    monkeypatch.setattr(SinkRouter, "assign", lambda self, block: calls.append(block.first) or decoded.append(
        block.vectors.shape[-2]) or assign(self, block))
    monkeypatch.setattr(SinkRouter, "fixed_ranks", lambda self, kind, first, tokens: fixed.append((first, tokens)) or fixed_ranks(
        self, kind, first, tokens))
    skipped = run()
    assert skipped.engine.stores[0]["keys"].flushes > 1
    assert not calls  # the sinks' ranks are known without the block: assign never reads one
    assert fixed and {first for first, _ in fixed} == {0}  # only the prompt's block, which holds the sinks, is reconstructed
    # of its 192 tokens, the keys' first group (channel-alloc: 64 tokens), the values' first 3 (per-token codes)
    assert {tokens for _, tokens in fixed} == ({64, 3} if name == "s-sinks" else {3})
    monkeypatch.setattr(SinkRouter, "routed_tokens", lambda self, kind, first: None)
    monkeypatch.setattr(SinkRouter, "fixed_ranks", lambda self, kind, first, tokens: None)
    routed = run()
    assert max(calls) > 0  # every block routed by assign
    assert decoded[0] == 192  # the prompt's block whole
    assert skipped.memory_breakdown() == routed.memory_breakdown()
    for a, b in zip(skipped.engine.stores, routed.engine.stores, strict=True):
        for kind in ("keys", "values"):
            for field, tensor in a[kind].coefficients.fields.items():
                assert torch.equal(tensor, b[kind].coefficients.fields[field]), (kind, field)
    for a, b in zip(skipped.engine.windows, routed.engine.windows, strict=True):
        for kind in ("keys", "values"):
            for rank, lists in a.residuals[kind].items():
                for field, tensor in lists.fields.items():
                    assert torch.equal(tensor, b.residuals[kind][rank].fields[field]), (kind, rank, field)
