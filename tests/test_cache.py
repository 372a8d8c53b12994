"""KVWeaveCache on a tiny random Llama: exactness of `full`, real byte savings, bounded error,
compression during decoding, batch operations and clear errors."""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import DynamicCache

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import model_shape
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.registry import load_pipeline

from conftest import tiny_llama


def _inputs(batch: int = 2, length: int = 300, pad: int = 20, seed: int = 3):
    torch.manual_seed(seed)
    ids = torch.randint(0, 128, (batch, length))
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_full_pipeline_generates_exactly_what_dynamic_cache_generates(tiny_model):
    inputs = _inputs()
    options = dict(max_new_tokens=30, do_sample=False, output_scores=True, return_dict_in_generate=True)
    ref = tiny_model.generate(**inputs, **options, **cache_kwargs(tiny_model, DynamicCache(config=tiny_model.config)))
    ours = tiny_model.generate(**inputs, **options, **cache_kwargs(tiny_model, build_cache("full", tiny_model)))
    assert torch.equal(ours.sequences, ref.sequences)
    assert all(torch.equal(a, b) for a, b in zip(ours.scores, ref.scores))


def _prefill(model, pipeline, inputs):
    cache = build_cache(pipeline, model)
    with torch.inference_mode():
        model(**inputs, use_cache=True, **cache_kwargs(model, cache))
    return cache


@pytest.mark.parametrize("pipeline, floor", [("int8", 1.8), ("int4", 3.0)])
def test_quantized_pipelines_store_fewer_real_bytes(pipeline, floor):
    # head_dim 64: int8 costs 64 + 2 bytes per vector, int4 32 + 4, against 128 at 16 bits; with 128 exact
    # tokens out of 2048 that is 1.83x and 3.07x
    model = tiny_llama(torch.bfloat16, hidden=256)
    cache = _prefill(model, pipeline, _inputs(batch=1, length=2048, pad=0))
    full = _prefill(model, "full", _inputs(batch=1, length=2048, pad=0))
    assert full.memory_bytes() == full.full_cache_bytes_16bit()  # bf16 full cache is the 16-bit reference
    assert cache.compression_ratio() > floor
    assert cache.memory_bytes() < full.memory_bytes() / floor
    # the exact copies of compressed tokens are gone: each window holds less than window + one block
    settings = cache.pipeline.settings
    for window in cache.engine.views():
        for tensor in (window.keys.exact, window.values.exact):
            assert tensor.shape[-2] < settings.recent_window + settings.block_tokens
            assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("pipeline, bound", [("int8", 0.02), ("int4", 0.2), ("int4-outliers", 0.15)])
def test_reconstruction_error_is_bounded(tiny_model, pipeline, bound):
    inputs = _inputs(batch=2, length=400, pad=0)
    reference = DynamicCache(config=tiny_model.config)
    with torch.inference_mode():
        tiny_model(**inputs, use_cache=True, **cache_kwargs(tiny_model, reference))
    cache = _prefill(tiny_model, pipeline, inputs)
    compressed = cache.engine.view(0).packed_tokens
    assert compressed == 256  # 400 - 128 exact, rounded down to whole 64-token blocks
    for layer in range(len(cache.layers)):
        for kind in ("keys", "values"):
            exact = getattr(reference.layers[layer], kind)[..., :compressed, :]
            restored = cache.engine.reconstruct(layer, kind, torch.float32)
            error = (restored - exact).norm() / exact.norm()
            assert error < bound, (layer, kind, float(error))


def test_outlier_residuals_reduce_the_error_of_int4(tiny_model):
    inputs = _inputs(batch=1, length=400, pad=0)
    reference = DynamicCache(config=tiny_model.config)
    with torch.inference_mode():
        tiny_model(**inputs, use_cache=True, **cache_kwargs(tiny_model, reference))
    errors = {}
    for pipeline in ("int4", "int4-outliers"):
        cache = _prefill(tiny_model, pipeline, inputs)
        restored = cache.engine.reconstruct(1, "keys", torch.float32)
        exact = reference.layers[1].keys[..., : restored.shape[-2], :]
        errors[pipeline] = float((restored - exact).norm() / exact.norm())
        if pipeline == "int4-outliers":
            assert cache.memory_breakdown()["residuals"] > 0
    assert errors["int4-outliers"] < errors["int4"]


def test_compression_continues_during_decoding(tiny_model):
    cache = _prefill(tiny_model, "int4", _inputs(batch=1, length=150, pad=0))
    assert cache.engine.view(0).packed_tokens == 0  # 150 < 128 + 64
    token = torch.tensor([[5]])
    seen = []
    with torch.inference_mode():
        for _ in range(120):
            tiny_model(input_ids=token, use_cache=True, **cache_kwargs(tiny_model, cache))
            seen.append(cache.engine.view(0).packed_tokens)
    assert cache.get_seq_length() == 270
    assert seen[-1] == 128 and seen[41] == 64 and seen[40] == 0  # a block leaves at 192 and 256 tokens
    assert all(w.exact_tokens < 192 for w in cache.engine.views())


def test_sampling_and_batches_with_left_padding_run(tiny_model):
    torch.manual_seed(0)
    cache = build_cache("int4-outliers", tiny_model)
    out = tiny_model.generate(**_inputs(), max_new_tokens=20, do_sample=True, top_k=20, **cache_kwargs(tiny_model, cache))
    assert out.shape == (2, 320)
    assert cache.get_seq_length() == 319


def test_batch_selection_reorders_every_stored_tensor(tiny_model):
    cache = _prefill(tiny_model, "int4-outliers", _inputs(batch=2, length=300, pad=0))
    before = [cache.engine.reconstruct(layer, "values", torch.float32) for layer in range(3)]
    cache.reorder_cache(torch.tensor([1, 0, 1]))
    assert cache.batch_size == 3
    for layer in range(3):
        after = cache.engine.reconstruct(layer, "values", torch.float32)
        assert torch.equal(after, before[layer][[1, 0, 1]])


def test_beam_search_runs_on_a_compressed_cache(tiny_model):
    cache = build_cache("int4-outliers", tiny_model)
    out = tiny_model.generate(**_inputs(), max_new_tokens=8, num_beams=3, do_sample=False, **cache_kwargs(tiny_model, cache))
    assert out.shape == (2, 308)


def test_crop_is_refused_rather_than_corrupting(tiny_model):
    cache = _prefill(tiny_model, "int4", _inputs(batch=1, length=300, pad=0))
    with pytest.raises(CacheStateError, match="cannot crop"):
        cache.crop(-5)


def test_a_quantizer_block_that_does_not_fit_the_head_dim_is_a_model_error(tmp_path):
    path = tmp_path / "r.toml"
    path.write_text(textwrap.dedent("""
        [pipelines.odd]
        extends = "int8"
        [pipelines.odd.quantizer]
        block = 12
    """))
    with pytest.raises(ModelError, match="pipeline 'odd'.*block=12.*16"):
        build_cache(load_pipeline("odd", path), tiny_llama())


def test_unsupported_layer_types_are_refused(tiny_model):
    config = tiny_model.config.__class__(**tiny_model.config.to_dict())
    config.layer_types = ["full_attention", "mamba", "full_attention"]
    with pytest.raises(ModelError, match="mamba"):
        model_shape(config)


def test_memory_bytes_counts_every_part(tiny_model):
    cache = _prefill(tiny_model, "int4-outliers", _inputs(batch=2, length=400, pad=0))
    parts = cache.memory_breakdown()
    assert parts["exact_window"] > 0 and parts["coefficients"] > 0 and parts["residuals"] > 0
    assert cache.memory_bytes() == sum(parts.values())
    shape = cache.shape
    # int4 group 16 (head_dim 16): 8 bytes of codes + one float16 scale per token, head, layer, K and V
    assert parts["coefficients"] == 2 * shape.num_layers * 2 * shape.num_kv_heads * 256 * (8 + 2)


def test_keys_and_values_with_their_own_quantizers_store_each_in_its_format(tiny_model, tmp_path):
    path = tmp_path / "kinds.toml"
    path.write_text(textwrap.dedent("""
        [pipelines.k4v8]
        extends = "int4"
        [pipelines.k4v8.values.quantizer]
        use = "int8-block"
        block = 16
    """))
    inputs = _inputs(pad=0)  # one storage for the batch (a left-padded one is kept row by row: test_padded_rows.py)
    caches = {name: _prefill(tiny_model, load_pipeline(name, path), inputs) for name in ("int4", "k4v8", "int8")}
    view = caches["k4v8"].engine.view(0)
    assert view.keys.coefficient_format == "int4-group.v1" and view.values.coefficient_format == "int8-block.v1"
    assert view.keys.coefficients["packed"].dtype == torch.uint8 and view.values.coefficients["codes"].dtype == torch.int8
    coefficients = {name: cache.memory_breakdown()["coefficients"] for name, cache in caches.items()}
    assert coefficients["int4"] < coefficients["k4v8"] < coefficients["int8"]
    # keys decode exactly as int4 alone decodes them
    assert torch.equal(caches["k4v8"].engine.materialize(0, "keys"), caches["int4"].engine.materialize(0, "keys"))


@pytest.mark.parametrize("pipeline", ["int4", "kivi-2", "int8"])
def test_non_finite_keys_or_values_are_refused_naming_the_layer(tiny_model, pipeline):
    cache = build_cache(pipeline, tiny_model)
    keys = torch.randn(1, 2, 300, 16)
    values = torch.randn(1, 2, 300, 16)
    values[0, 1, 40, 3] = float("nan")
    cache.update(keys, keys, 0)  # one-layer groups: each layer flushes its own block
    with pytest.raises(CacheStateError, match=r"layer 1 sent non-finite values \(first at batch row 0, KV head 1, token 40\)"):
        cache.update(keys, values, 1)
