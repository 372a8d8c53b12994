"""Decode steps captured in CUDA graphs on a GPU (``kvweave.engine.graphs``): the frontier pipeline with its window
as int8 codes or as the tokens arrived, and depthweave-kv's fused kernel, decode the tokens and store the tensors
``model.generate`` does, most steps replayed. Skipped without a CUDA GPU (``tests/test_graphs.py`` runs the same
steps eagerly on a CPU)."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.graphs import _Step, graph_decode
from kvweave.engine.importance import score_for

from conftest import CharTokenizer, write_registry
from test_graphs import FRONTIER, _depthweave_stored, _stored, _Vocabulary


def _gpu_llama(vocab: int, layers: int):
    """A random bfloat16 Llama on the GPU, head_dim 128 (8 query heads, 2 KV heads), and two rows of 300 prompt ids."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=1024, intermediate_size=1024, num_hidden_layers=layers,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    net = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    net.generation_config.eos_token_id = None
    return net, torch.randint(1, vocab, (2, 300), generator=torch.Generator().manual_seed(0)).cuda()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
@pytest.mark.parametrize("window", ["int8", "input"])
def test_graphs_captured_on_the_gpu_decode_what_generate_does(monkeypatch, tmp_path, window):
    """bfloat16, head_dim 128 (the d128 frontier pipeline, its window as int8 codes or as the tokens arrived), two rows,
    200 steps over three flushes: the same tokens and stored tensors as ``model.generate``, most steps replayed."""
    net, ids = _gpu_llama(512, 3)
    registry = load_registry(FRONTIER)
    registry.add_file(write_registry(tmp_path, "window", f"""
[pipelines.g-window]
extends = "kzd-k4v2-f48-d128"
window_storage = "{window}"
"""))

    def prepared():
        cache = build_cache(registry.resolve("g-window"), net, tokenizer=CharTokenizer())
        score_for(net, cache, ids, False, None, ingest=True)
        return cache

    reference, cache = prepared(), prepared()
    with torch.no_grad():
        expected = net.generate(input_ids=ids, max_new_tokens=200, do_sample=False, **cache_kwargs(net, reference))[:, 300:]
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 300:]
    replays, eager = [], []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    run = _Step.__call__

    def counted(self, fill):
        if fill is not None and not torch.cuda.is_current_stream_capturing():
            eager.append(1)  # a block's eager step
        return run(self, fill)

    monkeypatch.setattr(_Step, "__call__", counted)
    got = graph_decode(net, cache, first, 199)
    assert torch.equal(torch.cat((first, got), 1), expected)
    assert len(replays) > 150
    assert len(eager) == 1  # the blocks after a flush are captured at once
    assert all(torch.equal(a, b) for a, b in zip(_stored(cache), _stored(reference), strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs")
def test_depthweave_kv_steps_captured_on_the_gpu_decode_what_generate_does(monkeypatch):
    """The flagship on the GPU (bfloat16, head_dim 128, the fused Triton kernel): 150 steps over two flushes, the same
    tokens and stored tensors as ``model.generate``, most steps replayed from graphs."""
    net, ids = _gpu_llama(128, 4)
    reference, cache = (build_cache("depthweave-kv", net, tokenizer=_Vocabulary()) for _ in range(2))
    with torch.no_grad():
        expected = net.generate(input_ids=ids, max_new_tokens=150, do_sample=False, **cache_kwargs(net, reference))[:, 300:]
        first = net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))[:, 300:]
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    got = graph_decode(net, cache, first, 149)
    assert torch.equal(torch.cat((first, got), 1), expected)
    assert len(replays) > 100
    assert all(torch.equal(a, b) for a, b in zip(_depthweave_stored(cache), _depthweave_stored(reference), strict=True))
