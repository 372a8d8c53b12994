"""Benchmarks of every built-in pipeline: prefill-and-compress time and single-token decode time.

The model is a randomly initialised ``LlamaForCausalLM`` with SmolLM2-135M's attention shape (head dim 64,
9 query heads, 3 KV heads, hidden 576, intermediate 1536) but only 4 layers and a 512-token vocabulary,
in float32 on CPU. Nothing is downloaded. Every pipeline of the built-in registry is a parameter, so a
pipeline added to ``registry.toml`` is benchmarked without editing this file.

In CI (each benchmarked function runs once, as a plain test; the assertions still run)::

    python -m pytest tests/test_benchmarks.py --benchmark-disable -q

Timing (only the benchmarks, with a table)::

    python -m pytest tests/test_benchmarks.py --benchmark-only --benchmark-columns=mean,stddev,rounds

Comparing runs: save a run, change the code, then compare against the saved one (runs are stored in
``.benchmarks/``; ``0001`` is the number of the saved run, printed when it is saved)::

    python -m pytest tests/test_benchmarks.py --benchmark-only --benchmark-save=baseline
    python -m pytest tests/test_benchmarks.py --benchmark-only --benchmark-compare=0001
    python -m pytest tests/test_benchmarks.py --benchmark-only --benchmark-compare=0001 \
        --benchmark-compare-fail=mean:10%      # fail if any mean got more than 10% slower
    pytest-benchmark compare 0001 0002 --columns=mean,stddev   # two saved runs side by side

Each prefill result also records, in ``extra_info`` (shown in the saved JSON), the bytes the cache
stored, what a 16-bit full cache would hold for the same tokens, and their ratio.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.pipeline import build_cache
from kvweave.engine.generation import cache_kwargs
from kvweave.engine.importance import score_for
from kvweave.core.registry import load_registry

from conftest import ToyTokenizer
from helpers import fit_layer_tables, fit_surrogate_weights

pytest.importorskip("pytest_benchmark")
transformers = pytest.importorskip("transformers")

# --- sizes (module constants: lower PREFILL_TOKENS if the CI machine is slow) ------------------------
PREFILL_TOKENS = 1024
DECODE_ROUNDS = 10
PREFILL_ROUNDS = 3

NUM_LAYERS = 4
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
HIDDEN = 576
INTERMEDIATE = 1536
VOCAB = 512

# What a cache holding every token exact in float32 (the model's dtype) stores: keys and values of every
# layer and KV head. A compressing pipeline must store less than this.
FLOAT32_BYTES_PER_TOKEN = 2 * NUM_LAYERS * NUM_KV_HEADS * HEAD_DIM * 4
UNCOMPRESSED_BYTES = PREFILL_TOKENS * FLOAT32_BYTES_PER_TOKEN

REGISTRY = load_registry()
PIPELINES = REGISTRY.names()

#: each pipeline's cache as ``test_prefill_and_compress`` left it (prefilled, checked), with its logits: taken over by
#: ``test_decode_step`` of the same pipeline (which prefills its own where the prefill test did not run or failed)
_PREFILLED: dict[str, tuple[KVWeaveCache, torch.Tensor]] = {}


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=PREFILL_TOKENS + DECODE_ROUNDS + 64,
        tie_word_embeddings=True,
    )
    built = transformers.LlamaForCausalLM(config).to(dtype=torch.float32, device="cpu").eval()
    return built


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (1, PREFILL_TOKENS), generator=generator)


def _forward(model: Any, input_ids: torch.Tensor, cache: KVWeaveCache) -> torch.Tensor:
    """One forward into ``cache``; positions come from ``cache.get_seq_length()``, the context scored first for an
    evictor that needs it (KVzip: part of its prefill). Returns the logits."""
    score_for(model, cache, input_ids)
    return model(input_ids=input_ids, use_cache=True, **cache_kwargs(model, cache)).logits


def _check_prefilled(name: str, cache: KVWeaveCache) -> None:
    assert cache.get_seq_length() == PREFILL_TOKENS
    stored = cache.memory_bytes()
    assert stored > 0
    if name == "full":
        # nothing compressed: exactly the float32 keys and values of every token
        assert stored == UNCOMPRESSED_BYTES
    else:
        assert stored < UNCOMPRESSED_BYTES, (
            f"pipeline '{name}' stored {stored} bytes, no less than the {UNCOMPRESSED_BYTES} bytes of "
            f"{PREFILL_TOKENS} uncompressed float32 tokens"
        )


@pytest.mark.parametrize("pipeline", PIPELINES, ids=PIPELINES)
def test_prefill_and_compress(benchmark: Any, model: Any, prompt: torch.Tensor, pipeline: str, tmp_path: Any) -> None:
    resolved = fit_surrogate_weights(fit_layer_tables(REGISTRY.resolve(pipeline), NUM_LAYERS), model, tmp_path)
    caches: list[KVWeaveCache] = []

    def setup() -> tuple[tuple[KVWeaveCache], dict[str, Any]]:
        cache = build_cache(resolved, model, tokenizer=ToyTokenizer(VOCAB))
        caches.append(cache)
        return (cache,), {}

    def prefill(cache: KVWeaveCache) -> torch.Tensor:
        with torch.inference_mode():
            return _forward(model, prompt, cache)

    logits = benchmark.pedantic(prefill, setup=setup, rounds=PREFILL_ROUNDS, iterations=1)

    assert logits.shape == (1, PREFILL_TOKENS, VOCAB)
    assert torch.isfinite(logits).all()
    cache = caches[-1]
    _check_prefilled(pipeline, cache)
    benchmark.extra_info["tokens"] = cache.get_seq_length()
    benchmark.extra_info["stored_bytes"] = cache.memory_bytes()
    benchmark.extra_info["full_16bit_bytes"] = cache.full_cache_bytes_16bit()
    benchmark.extra_info["ratio"] = cache.compression_ratio()
    _PREFILLED[pipeline] = (cache, logits)


@pytest.mark.parametrize("pipeline", PIPELINES, ids=PIPELINES)
def test_decode_step(benchmark: Any, model: Any, prompt: torch.Tensor, pipeline: str, tmp_path: Any) -> None:
    if pipeline in _PREFILLED:  # the prompt's prefill, as the prefill test ran it (one forward of the same prompt)
        cache, logits = _PREFILLED.pop(pipeline)
    else:
        resolved = fit_surrogate_weights(fit_layer_tables(REGISTRY.resolve(pipeline), NUM_LAYERS), model, tmp_path)
        cache = build_cache(resolved, model, tokenizer=ToyTokenizer(VOCAB))
        with torch.inference_mode():
            logits = _forward(model, prompt, cache)
    _check_prefilled(pipeline, cache)
    state = {"next": logits[:, -1:].argmax(dim=-1)}  # [1, 1]
    first_token = state["next"]
    lengths: list[int] = []
    first_logits: list[torch.Tensor] = []

    def decode_step() -> None:
        with torch.inference_mode():
            step_logits = _forward(model, state["next"], cache)
        assert step_logits.shape == (1, 1, VOCAB)
        if not first_logits:
            first_logits.append(step_logits[0, -1].clone())
        state["next"] = step_logits[:, -1:].argmax(dim=-1)
        lengths.append(cache.get_seq_length())

    benchmark.pedantic(decode_step, rounds=DECODE_ROUNDS, iterations=1, warmup_rounds=0)

    # one token appended per step (a single step when benchmarks are disabled)
    assert lengths, "the decode step never ran"
    assert lengths == list(range(PREFILL_TOKENS + 1, PREFILL_TOKENS + 1 + len(lengths)))
    assert all(layer.get_seq_length() == lengths[-1] for layer in cache.layers)
    assert cache.memory_bytes() > 0
    if pipeline == "full":
        # exact cache: the first step must equal an uncached forward of prompt + token, which fails if
        # the step's positions (from cache.get_seq_length()) did not continue the prompt's
        with torch.inference_mode():
            reference = model(input_ids=torch.cat((prompt, first_token), dim=1), use_cache=False).logits[0, -1]
        torch.testing.assert_close(first_logits[0], reference, rtol=1e-4, atol=1e-4)
    benchmark.extra_info["steps"] = len(lengths)
    benchmark.extra_info["tokens"] = lengths[-1]
    benchmark.extra_info["stored_bytes"] = cache.memory_bytes()
    benchmark.extra_info["ratio"] = cache.compression_ratio()
