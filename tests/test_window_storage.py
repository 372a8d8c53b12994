"""``window_storage = "int8"``: the tokens a cache holds uncompressed (recent window, the block not yet full,
kept sliding windows) stored as int8 per token and head with a float16 scale, counted at their real bytes."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.exact import ExactTokens

from conftest import tiny_llama, write_registry


def _registry(tmp_path):
    return write_registry(tmp_path, "window", """
[pipelines.w-input]
extends = "prerope-qa35v3"
recent_window = 16

[pipelines.w-int8]
extends = "w-input"
window_storage = "int8"

[pipelines.full-int8]
extends = "full"
window_storage = "int8"
""")


def test_int8_tokens_restore_within_half_a_step_and_cost_d_plus_2_bytes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 40, 64, dtype=torch.bfloat16) * torch.logspace(-2, 2, 64).to(torch.bfloat16)
    held = ExactTokens("int8")
    held["keys"] = x
    restored = held["keys"]
    assert restored.dtype == x.dtype and restored.shape == x.shape
    step = x.float().abs().amax(dim=-1, keepdim=True) / 127
    # half a step, plus bfloat16's rounding of the restored value
    assert bool(((restored.float() - x.float()).abs() <= step * 0.5 * 1.01 + x.float().abs() * 2**-8).all())
    assert held.nbytes() == 2 * 3 * 40 * (64 + 2)
    assert held.bytes_per_token("keys") == 2 * 3 * (64 + 2)


def test_dropping_and_selecting_rows_move_codes_without_quantizing_again():
    torch.manual_seed(1)
    held = ExactTokens("int8")
    held.append("values", torch.randn(3, 2, 10, 16))
    held.append("values", torch.randn(3, 2, 5, 16) * 100)
    before = held["values"]
    held.drop_front("values", 4)
    assert torch.equal(held["values"], before[..., 4:, :])
    held.select_rows(torch.tensor([2, 0, 0]))
    assert torch.equal(held["values"], before[[2, 0, 0]][..., 4:, :])
    assert held.tokens() == 0  # no keys were stored
    assert held.shape("values") == (3, 2, 11, 16)


def test_input_storage_returns_the_tensor_that_arrived():
    x = torch.randn(1, 2, 4, 8)
    held = ExactTokens("input")
    held["keys"] = x
    assert held["keys"] is x and not held.lossy
    with pytest.raises(ValueError, match="window_storage"):
        ExactTokens("int4")


def test_a_magnitude_beyond_a_float16_scale_is_refused_and_nan_reads_back_as_nan():
    held = ExactTokens("int8")
    with pytest.raises(ValueError, match="largest magnitude 1e[+]07 is beyond"):  # a prompt's tokens: at once
        held["keys"] = torch.full((1, 1, 2, 8), 1e7)
    # a decode step's token: its magnitude reaches the host on its own and the next append, or the engine's settle
    # before a flush, raises (no host read in the step itself)
    for later in (lambda: held.append("keys", torch.ones(1, 1, 1, 8)), lambda: held.settle()):
        held = ExactTokens("int8")
        held["keys"] = torch.ones(1, 1, 3, 8)
        held.append("keys", torch.full((1, 1, 1, 8), 2e7))
        with pytest.raises(ValueError, match="largest magnitude 2e[+]07 is beyond"):
            later()
    held = ExactTokens("int8")
    x = torch.ones(1, 1, 2, 8)
    x[0, 0, 1, 3] = float("nan")
    held["keys"] = x
    restored = held["keys"]
    assert torch.isnan(restored[0, 0, 1]).all() and torch.isfinite(restored[0, 0, 0]).all()


def test_int8_window_halves_the_window_bytes_and_keeps_the_prefill_exact(tmp_path):
    model = tiny_llama(torch.bfloat16, hidden=256)  # head_dim 64
    registry = _registry(tmp_path)
    ids = torch.randint(1, 128, (2, 150))
    outputs, caches = {}, {}
    for name in ("w-input", "w-int8"):
        cache = build_cache(load_pipeline(name, registry), model)
        with torch.no_grad():
            outputs[name] = model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits
        caches[name] = cache
    # the prefill attends over its own tokens as they arrived, whatever the window holds afterwards
    assert torch.equal(outputs["w-input"], outputs["w-int8"])
    parts = {name: cache.memory_breakdown() for name, cache in caches.items()}
    assert parts["w-input"]["coefficients"] == parts["w-int8"]["coefficients"]
    exact_tokens = caches["w-int8"].engine.windows[0].exact_tokens
    assert exact_tokens == 150 - 128  # two 64-token blocks compressed
    vectors = 2 * 2 * 2 * exact_tokens * model.config.num_hidden_layers  # rows x KV heads x (K, V) x tokens x layers
    assert parts["w-input"]["exact_window"] == vectors * 64 * 2
    assert parts["w-int8"]["exact_window"] == vectors * (64 + 2)
    assert caches["w-int8"].compression_ratio() > caches["w-input"].compression_ratio()


def test_an_int8_full_cache_decodes_close_to_the_exact_one(tmp_path):
    model = tiny_llama(torch.float32, hidden=128)
    registry = _registry(tmp_path)
    ids = torch.randint(1, 128, (1, 40))
    scores = {}
    for name in ("full", "full-int8"):
        cache = build_cache(load_pipeline(name, registry), model)
        with torch.no_grad():
            out = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache))
        scores[name] = torch.stack(out.scores)
    assert torch.equal(scores["full"][0], scores["full-int8"][0])  # the prefill's own tokens exact
    later = (scores["full"][1:] - scores["full-int8"][1:]).abs().max()
    assert 0 < later < 0.05 * scores["full"].abs().max()  # decoding reads int8 tokens: close, not equal


def test_non_finite_keys_are_still_named_at_the_flush(tmp_path):
    model = tiny_llama(torch.float32, hidden=256)
    cache = build_cache(load_pipeline("w-int8", _registry(tmp_path)), model)
    keys = torch.randn(1, 2, 100, 64)
    keys[0, 1, 7, 5] = float("inf")
    with pytest.raises(CacheStateError, match="non-finite keys"):
        for layer in range(model.config.num_hidden_layers):
            cache.engine.update(layer, keys, torch.randn(1, 2, 100, 64), materialize=False)
            cache.engine.after_attention(layer)  # the observing attention's call, which flushes


def test_generate_raises_for_a_last_step_token_beyond_the_range(tmp_path):
    """A decode token's range check reaches the host on its own and raises at the next append or flush; the last step
    of a generation has neither, so kvweave's generate settles the cache after decoding (it returned tokens read from
    NaN before)."""
    from kvweave.engine.generation import generate

    model = tiny_llama(torch.float32, hidden=256)
    ids = torch.randint(1, 128, (1, 40))
    calls = []

    def huge_at_the_last_step(module, args, output):
        calls.append(1)
        return output * 1e12 if len(calls) == 3 else output  # the prompt, then two decode steps; values: a layer's last append

    for new_tokens, raises in ((3, True), (2, False)):
        calls.clear()
        cache = build_cache(load_pipeline("w-int8", _registry(tmp_path)), model)
        handle = model.model.layers[0].self_attn.v_proj.register_forward_hook(huge_at_the_last_step)
        try:
            run = lambda: generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache,  # noqa: E731
                                   max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            if raises:
                with pytest.raises(ValueError, match="largest magnitude .* is beyond"):
                    run()
            else:
                run()
        finally:
            handle.remove()
