"""The contract every pipeline keeps: each pipeline of the built-in registry.toml builds a cache on a tiny random
model and generates a few tokens, storing fewer bytes than a 16-bit cache where it compresses
(:data:`PIPELINE_SKIPS` lists the pipelines such a model cannot hold); the shared test pipelines of
tests/pipelines.toml are named, explained and resolve. (The components' own contract: test_contract.py.)"""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache
from kvweave.engine.generation import generate

from conftest import TEST_PIPELINES, ToyTokenizer, tiny_llama
from helpers import fit_layer_tables, fit_surrogate_weights, layer_tables, random_inputs

#: built-in pipelines the tiny model of test_every_builtin_pipeline_generates cannot hold -> why
PIPELINE_SKIPS: dict[str, str] = {}


def test_every_pipeline_skip_names_a_builtin_pipeline():
    assert set(PIPELINE_SKIPS) <= set(load_registry().names())


def _pipeline_comments(path) -> dict[str, str]:
    """The comment lines right above each ``[pipelines.NAME]`` header of a registry file, by NAME."""
    comments, above = {}, []
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            above.append(stripped.lstrip("#").strip())
            continue
        if stripped.startswith("[pipelines.") and stripped.count(".") == 1:
            comments[stripped[len("[pipelines.") : -1]] = " ".join(above).strip()
        above = []
    return comments


def test_the_shared_test_pipelines_are_named_explained_and_resolve():
    """tests/pipelines.toml: every pipeline's name starts with t-, a comment says what it is for, and every
    one not marked INVALID (those fail on purpose; their tests check how) resolves."""
    comments = _pipeline_comments(TEST_PIPELINES)
    registry = load_registry(TEST_PIPELINES)
    ours = [name for name in registry.names() if registry.sources[name] == str(TEST_PIPELINES)]
    assert ours and sorted(ours) == sorted(comments)
    for name in ours:
        assert name.startswith("t-"), name
        assert comments[name], f"pipeline '{name}' in {TEST_PIPELINES.name} has no comment saying what it is for"
        if not comments[name].startswith("INVALID"):
            registry.resolve(name)


# ============================================================================================ every pipeline
PIPELINES = load_registry().names()
PROMPT, NEW = 320, 4  # more tokens than any built-in exact window plus one block


@pytest.fixture(scope="module")
def pipeline_model():
    """4 layers, head_dim 64 (what the fused kernel and the head-mode router need), bfloat16."""
    return tiny_llama(torch.bfloat16, layers=4, hidden=256)


@pytest.mark.parametrize("name", PIPELINES)
def test_every_builtin_pipeline_generates_on_a_tiny_model(pipeline_model, name, tmp_path):
    if name in PIPELINE_SKIPS:
        pytest.skip(f"pipeline '{name}': {PIPELINE_SKIPS[name]}")
    pipeline = load_registry().resolve(name)
    if fit_surrogate_weights(pipeline, pipeline_model, tmp_path) is not pipeline:  # a scorer fitted for a named model: refused here
        with pytest.raises(ModelError, match=r"the surrogate was fitted for \d+ layers x \d+ KV heads"):
            build_cache(pipeline, pipeline_model, tokenizer=ToyTokenizer())
        pipeline = fit_surrogate_weights(pipeline, pipeline_model, tmp_path)
    if any(length != 4 for length in layer_tables(pipeline).values()):  # tuned for a named model: refused here
        with pytest.raises(ModelError, match=r"layer_bits has \d+ entries but the model has 4 layers"):
            build_cache(pipeline, pipeline_model, tokenizer=ToyTokenizer())
        pipeline = fit_layer_tables(pipeline, 4)
    cache = build_cache(pipeline, pipeline_model, tokenizer=ToyTokenizer())
    new, stats = generate(pipeline_model, random_inputs(1, PROMPT, seed=5), cache, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert new.shape == (1, NEW) and stats.cached_tokens == PROMPT + NEW - 1
    assert 0 < stats.stored_bytes == cache.memory_bytes()
    if pipeline.settings.compress:
        assert stats.ratio > 1.0, stats.breakdown  # a bfloat16 model: less than a 16-bit full cache
    else:
        assert stats.ratio == 1.0
