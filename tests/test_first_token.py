"""Greedy generation with a cache that scores its prompt (``kvweave.engine.generation``): the first token is the argmax
of the scoring pass's last logits and no forward of the prompt follows; options that change the first token's logits
keep the forward of the prompt's last token; an end-of-sequence first token ends the rows."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from kvweave.engine import build_cache
from kvweave.engine.generation import first_token_refusal, generate

from conftest import CharTokenizer
from test_ingest import _fed_lengths
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


def _inputs(seed: int = 6, batch: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, 128, (batch, 200), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


@pytest.mark.parametrize("options, why", [
    ({"do_sample": True}, "sampling"),
    ({"num_beams": 2}, "beams"),
    ({"repetition_penalty": 1.3}, "repetition_penalty"),
    ({"min_new_tokens": 3}, "min_new_tokens"),
    ({"logits_processor": LogitsProcessorList([lambda ids, scores: scores])}, "logits_processor"),
    ({}, "max_new_tokens"),
])
def test_options_that_change_the_first_tokens_logits_are_named(model, options, why):  # noqa: F811
    assert first_token_refusal(model, _inputs(), {"max_new_tokens": 4, **options} if why != "max_new_tokens" else options) is not None
    assert why in first_token_refusal(model, _inputs(), {"max_new_tokens": 4, **options} if why != "max_new_tokens" else options)
    assert first_token_refusal(model, _inputs(), {"max_new_tokens": 4, "do_sample": False}) is None
    assert "inputs" in first_token_refusal(model, {**_inputs(), "token_type_ids": torch.zeros(1, 200)}, {"max_new_tokens": 4})


def test_a_repetition_penalty_keeps_the_forward_of_the_last_prompt_token(model, registry):  # noqa: F811
    inputs = _inputs()
    cache = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    with _fed_lengths(model) as fed:
        tokens, stats = generate(model, dict(inputs), cache, max_new_tokens=4, do_sample=False, repetition_penalty=1.3)
    assert fed.count(1) == 4 and tokens.shape == (1, 4)  # the prompt's last token, then three steps
    assert stats.cached_tokens == 203
    plain = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    with _fed_lengths(model) as fed:
        generate(model, dict(inputs), plain, max_new_tokens=4, do_sample=False)
    assert fed.count(1) == 3  # the first token from the scoring pass, then three steps


def test_an_end_of_sequence_first_token_ends_the_generation(model, registry):  # noqa: F811
    inputs = _inputs(batch=2)
    probe = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    first, _ = generate(model, dict(inputs), probe, max_new_tokens=1, do_sample=False)
    assert first.shape == (2, 1)
    cache = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    with _fed_lengths(model) as fed:
        tokens, _ = generate(model, dict(inputs), cache, max_new_tokens=5, do_sample=False,
                             eos_token_id=[int(first[0, 0]), int(first[1, 0])], pad_token_id=0)
    assert tokens.tolist() == first.tolist() and fed.count(1) == 0  # both rows ended at once: no step after
    one = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    tokens, _ = generate(model, dict(inputs), one, max_new_tokens=5, do_sample=False, eos_token_id=int(first[0, 0]), pad_token_id=0)
    if int(first[1, 0]) != int(first[0, 0]):  # row 0 ended with its first token: padded after it while row 1 goes on
        assert tokens[0, 0] == first[0, 0] and (tokens[0, 1:] == 0).all() and tokens.shape[1] > 1


def test_graph_decoding_after_a_first_token_from_the_scoring_pass_decodes_what_generate_does(model, registry):  # noqa: F811
    """``cuda_graphs`` (eager steps here, off a GPU): the steps after the first token start from the stored prompt
    (KVzip over channel-group keys stored before RoPE)."""
    inputs = _inputs(seed=9)
    plain = build_cache(registry.resolve("t-lowbit-kvzip-cg"), model, tokenizer=CharTokenizer())
    expected, _ = generate(model, dict(inputs), plain, max_new_tokens=7, do_sample=False)
    graphed = build_cache(registry.resolve("t-lowbit-kvzip-cg"), model, tokenizer=CharTokenizer())
    with _fed_lengths(model) as fed:
        tokens, stats = generate(model, dict(inputs), graphed, max_new_tokens=7, do_sample=False, cuda_graphs=True)
    assert tokens.tolist() == expected.tolist() and fed.count(1) == 6
    assert stats.cached_tokens == plain.get_seq_length() == 206


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures CUDA graphs on a GPU")
def test_graphs_captured_on_a_gpu_after_the_scoring_pass_decode_what_generate_does(monkeypatch):
    """bfloat16, head_dim 128, the d128 frontier pipeline (KVzip's scores), two rows: the first token from the scoring
    pass, then 120 steps over two flushes, most replayed from graphs; the same tokens as without graphs."""
    from kvweave.core.registry import load_registry

    from test_graphs import FRONTIER
    from test_graphs_gpu import _gpu_llama

    net, ids = _gpu_llama(512, 3)
    registry = load_registry(FRONTIER)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plain = build_cache(registry.resolve("kzd-k4v2-f48-d128"), net, tokenizer=CharTokenizer())
    expected, _ = generate(net, dict(inputs), plain, max_new_tokens=121, do_sample=False)
    replays = []
    original = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or original(self))
    graphed = build_cache(registry.resolve("kzd-k4v2-f48-d128"), net, tokenizer=CharTokenizer())
    tokens, _ = generate(net, dict(inputs), graphed, max_new_tokens=121, do_sample=False, cuda_graphs=True)
    assert torch.equal(tokens, expected)
    assert len(replays) > 80
