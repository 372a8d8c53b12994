"""Keys stored before the rotary embedding (``key_space = "pre-rope"``, engine/rotary.py): the round trip
is exact to float rounding, bytes are what the same storage costs after RoPE, and what cannot work is
refused naming the setting and the slot or the model."""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvweave.core.errors import ModelError, RegistryError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.rotary import RotaryInverse

from conftest import tiny_llama

REGISTRY = textwrap.dedent("""
    [pipelines.t-exact-pre]
    extends = "full"
    compress = true
    recent_window = 8
    block_tokens = 16
    key_space = "pre-rope"

    [pipelines.t-exact-post]
    extends = "t-exact-pre"
    key_space = "post-rope"

    [pipelines.t-int4-pre]
    extends = "int4"
    recent_window = 16
    key_space = "pre-rope"

    [pipelines.t-int4-post]
    extends = "t-int4-pre"
    key_space = "post-rope"

    [pipelines.t-fused-pre]
    extends = "depthweave-kv"
    key_space = "pre-rope"

    [pipelines.t-h2o-pre]
    extends = "h2o"
    key_space = "pre-rope"
""")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    path = tmp_path_factory.mktemp("prerope") / "prerope.toml"
    path.write_text(REGISTRY)
    return path


def _prefill(model, cache, ids, mask=None):
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
    return cache


def _ids(batch=2, length=120, seed=5):
    torch.manual_seed(seed)
    return torch.randint(1, 128, (batch, length))


def test_the_rotary_inverse_undoes_the_models_rotation_at_any_position():
    model = tiny_llama(torch.float64)
    inverse = RotaryInverse.from_model(model, 16, "test")
    keys = torch.randn(3, 5, 16, dtype=torch.float64)
    positions = torch.tensor([0, 1, 17, 900, 4000])
    rotated = inverse.rotate(keys, 0, positions)
    cos, sin = model.model.rotary_emb(keys, positions[None])  # the model's own angles
    expected = keys * cos[0] + torch.cat((-keys[..., 8:], keys[..., :8]), dim=-1) * sin[0]
    assert torch.allclose(rotated.double(), expected, atol=1e-5)
    assert torch.allclose(inverse.unrotate(rotated, 0, positions).double(), keys, atol=1e-5)
    assert not torch.allclose(inverse.unrotate(rotated, 0, positions + 1).double(), keys, atol=1e-3)


def test_pre_rope_storage_without_quantization_returns_the_models_keys(registry):
    model = tiny_llama(torch.float64)
    ids = _ids()
    mask = torch.ones_like(ids)
    mask[0, :9] = 0  # a left-padded row: stored at its own positions, undone exactly
    cache = _prefill(model, build_cache(load_pipeline("t-exact-pre", registry), model), ids, mask)
    plain = _prefill(model, build_cache("full", model), ids, mask)
    reference = plain.layers[1].engine.materialize(1, "keys")
    first, second = cache.engine.rows.engines  # a left-padded batch is kept row by row (engine/rows.py)
    assert second.views()[1].packed_tokens == 112
    for row, engine, pad in ((0, first, 9), (1, second, 0)):
        assert torch.allclose(engine.materialize(1, "keys")[0], reference[row, :, pad:], atol=1e-7)  # float32 angles
    # what is stored is not the rotated key (token 50 of row 1 sits at position 50)
    post = _prefill(model, build_cache(load_pipeline("t-exact-post", registry), model), ids, mask)
    field = next(iter(second.view(1).keys.coefficients))
    pre_stored = second.view(1).keys.coefficients[field][0, 0, :, 50]
    post_stored = post.engine.rows.engines[1].view(1).keys.coefficients[field][0, 0, :, 50]
    assert not torch.allclose(pre_stored, post_stored, atol=1e-3)


def test_pre_rope_int4_stores_the_same_bytes_and_generates(registry):
    model = tiny_llama()
    ids = _ids(batch=1, length=150)
    caches = {name: build_cache(load_pipeline(name, registry), model) for name in ("t-int4-pre", "t-int4-post")}
    outputs = {name: model.generate(input_ids=ids, max_new_tokens=20, do_sample=False, pad_token_id=0, **cache_kwargs(model, c))
               for name, c in caches.items()}
    assert caches["t-int4-pre"].memory_bytes() == caches["t-int4-post"].memory_bytes()
    assert outputs["t-int4-pre"].shape == outputs["t-int4-post"].shape == (1, 170)
    # both decode the stored keys close to the exact ones (4 bits per channel)
    exact = _prefill(model, build_cache("full", model), ids)
    for cache in (caches.values()):
        keys = cache.engine.materialize(0, "keys")[..., :128, :]
        truth = exact.engine.materialize(0, "keys")[..., :128, :]
        assert ((keys - truth).norm() / truth.norm()) < 0.2


def test_a_kernel_that_cannot_rotate_stored_keys_is_refused_at_resolve_time(registry):
    with pytest.raises(RegistryError, match=r"t-fused-pre.*key_space = 'pre-rope'.*slot 'kernel' \('fused'\)"):
        load_pipeline("t-fused-pre", registry)


def test_reselecting_evictors_refuse_pre_rope_keys(registry):
    with pytest.raises(Exception, match=r"slot 'evictor' \('h2o'\).*key_space = 'pre-rope'"):
        build_cache(load_pipeline("t-h2o-pre", registry), tiny_llama())


def test_a_length_dependent_rotary_embedding_is_refused():
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    model = LlamaForCausalLM(config).eval()
    with pytest.raises(ModelError, match=r"cannot invert rotary embedding type \['dynamic'\]"):
        build_cache(load_pipeline("int4-prerope"), model)


def test_a_cache_without_its_model_says_how_to_get_the_rotary_module(registry):
    from kvweave.engine.cache import KVWeaveCache

    model = tiny_llama()
    cache = KVWeaveCache(load_pipeline("t-int4-pre", registry), model.config)  # never bound to the model
    with pytest.raises(Exception, match=r"key_space 'pre-rope'.*build_cache\(pipeline, model\)"):
        _prefill(model, cache, _ids(batch=1, length=80))
