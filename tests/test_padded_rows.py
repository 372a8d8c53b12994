"""A left-padded row of a batch gets what it gets alone, for every pipeline of the registry: a compressing
pipeline keeps each row of a left-padded batch in an engine of its own (engine/rows.py); ``full`` stores the
batch as the model's own cache does."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.importance import needs_importance, score_for

from conftest import ToyTokenizer, tiny_llama
from helpers import fit_layer_tables, fit_surrogate_weights

PIPELINES = sorted(load_registry().names())
PAD, LENGTH, NEW = 45, 190, 10


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32, hidden=256, layers=4)  # head_dim 64 (the fused kernels take it), windows of 4 layers


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 128, (2, LENGTH), generator=torch.Generator().manual_seed(11))


def _generate(model, name, ids, mask=None, **options):
    cache = build_cache(fit_layer_tables(load_pipeline(name), 4), model, tokenizer=ToyTokenizer())
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # budget warnings of float32 windows at these tiny lengths
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=0, **options, **cache_kwargs(model, cache))
    return out, cache


@pytest.mark.parametrize("name", PIPELINES)
def test_a_left_padded_row_gives_what_it_gives_alone(model, ids, name, tmp_path):
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    pipeline = fit_surrogate_weights(fit_layer_tables(load_pipeline(name), 4), model, tmp_path)
    scored = build_cache(pipeline, model, tokenizer=ToyTokenizer())
    if needs_importance(scored):  # an evictor scoring whole rows of context (KVzip) refuses a padded batch, saying so
        with pytest.raises(CacheStateError, match="this batch is padded"):
            score_for(model, scored, ids, attention_mask=mask)
        return
    batch, cache = _generate(model, name, ids, mask)
    alone, first = _generate(model, name, ids[:1, PAD:])
    other, second = _generate(model, name, ids[1:])
    assert torch.equal(batch.sequences[0, LENGTH:], alone.sequences[0, LENGTH - PAD:])
    assert torch.equal(batch.sequences[1, LENGTH:], other.sequences[0, LENGTH:])
    for step, (a, b, c) in enumerate(zip(batch.scores, alone.scores, other.scores)):
        assert torch.allclose(a[0], b[0], atol=1e-4), (step, (a[0] - b[0]).abs().max())
        assert torch.allclose(a[1], c[0], atol=1e-4), (step, (a[1] - c[0]).abs().max())
    if cache.engine.rows is not None:  # per-row storage: the padding is not stored, each row holds what it holds alone
        assert cache.memory_bytes() == first.memory_bytes() + second.memory_bytes()


def test_per_row_storage_follows_beams_and_says_where_its_views_are(model, ids):
    mask = torch.ones_like(ids)
    mask[1, :PAD] = 0
    out, cache = _generate(model, "int4", ids, mask, num_beams=2)
    assert out.sequences.shape == (2, LENGTH + NEW)
    rows = cache.engine.rows
    assert rows is not None and len(rows.engines) == cache.batch_size == 4  # two beams a row, copied apart
    assert len({id(engine) for engine in rows.engines}) == 4
    with pytest.raises(CacheStateError, match=r"engine of its own.*rows.engines\[i\]\.views"):
        cache.engine.views()


def test_a_mask_with_a_hole_is_refused(model, ids):
    mask = torch.ones_like(ids)
    mask[0, 50:60] = 0
    with pytest.raises(CacheStateError, match="left padding only"):
        _generate(model, "int4", ids, mask)


@pytest.mark.model
def test_int4_on_the_default_model_gives_a_padded_prompt_what_it_gives_alone(real_model):
    """The case that was reported: int4, two prompts of 272 and 375 tokens of the example report in one
    left-padded batch; the shorter one used to change from its 16th generated token."""
    from pathlib import Path

    model, tokenizer = real_model
    text = (Path(__file__).parents[1] / "examples" / "prompts" / "harbour-report.txt").read_text()
    ids = tokenizer(text + "\n" + text, return_tensors="pt").input_ids[:, :375]
    short = ids[:, :272]
    batch = torch.cat((torch.cat((torch.zeros(1, 103, dtype=torch.long), short), dim=1), ids))
    mask = (torch.arange(375)[None, :] >= torch.tensor([[103], [0]])).long()
    options = dict(max_new_tokens=24, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        together = model.generate(input_ids=batch, attention_mask=mask, **options,
                                  **cache_kwargs(model, build_cache(load_pipeline("int4"), model)))
        alone = model.generate(input_ids=short, **options, **cache_kwargs(model, build_cache(load_pipeline("int4"), model)))
    assert torch.equal(together[0, 375:], alone[0, 272:])


def test_a_mask_left_from_another_call_is_not_taken(model, ids):
    mask = torch.ones_like(ids)
    mask[0, :PAD] = 0
    _generate(model, "int4", ids, mask)  # the model's mask hook now holds that padded mask
    cache = build_cache(load_pipeline("int4"), model)
    keys = torch.randn(2, 2, 7, 64)
    cache.engine.update(0, keys, keys.clone())  # filled directly, without a forward of the model
    assert cache.engine.rows is None and cache.engine.batch_size() == 2
