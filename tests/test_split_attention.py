"""The repetition's attention in two parts merged by their log-sum-exp (engine/split_attention.py)."""

from __future__ import annotations

import pytest
import torch

from kvweave.engine import importance
from kvweave.engine.split_attention import math_part, merge_parts, split_attention, split_ready


def _grouped(batch=2, q_heads=8, heads=2, fed=7, context=23, dim=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, q_heads, fed, dim, generator=g)
    k = torch.randn(batch, heads, context + fed, dim, generator=g) * 2
    v = torch.randn(batch, heads, context + fed, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("fed, context", [(7, 23), (1, 40), (16, 3)])
def test_the_merged_parts_are_the_attention_over_all_keys(fed, context):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = _grouped(fed=fed, context=context)
    scaling = 0.3
    parts = [math_part(q, k[..., :context, :], v[..., :context, :], scaling, causal=False),
             math_part(q, k[..., context:, :], v[..., context:, :], scaling, causal=True)]
    merged = merge_parts(parts, torch.float32)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(fed, context + fed), scale=scaling,
                                                             enable_gqa=True)
    torch.testing.assert_close(merged, whole, rtol=1e-5, atol=1e-5)
    # each part alone is not it, and a part's weight depends on its own log-sum-exp
    assert not torch.allclose(parts[0][0], whole, atol=1e-3)
    wrong = merge_parts([(parts[0][0], parts[0][1] + 1.0), parts[1]], torch.float32)
    assert not torch.allclose(wrong, whole, atol=1e-3)


def test_the_math_part_is_causal_at_the_last_key():
    q, k, v = _grouped(fed=5, context=0)
    out, lse = math_part(q, k, v, 1.0, causal=True)
    # the first query sees the first key only
    torch.testing.assert_close(out[:, :, 0], v[:, :, :1].repeat_interleave(4, 1)[:, :, 0])
    assert lse.shape == q.shape[:3]


def test_the_split_is_not_taken_on_a_cpu():
    q, k, v = _grouped()
    assert not split_ready(q.to(torch.bfloat16))
    assert split_attention(q, k, v, 0.25) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN and flash attention run on a GPU")
@pytest.mark.parametrize("dim", [64, 128])
def test_the_split_on_the_gpu_matches_one_flash_call(dim):
    from torch.nn.attention.bias import causal_lower_right

    q, k, v = (t.cuda().to(torch.bfloat16) for t in _grouped(batch=1, q_heads=32, heads=8, fed=300, context=4000, dim=dim))
    k[..., 4000:, :] *= 3  # the repetition's own keys carry much of each row's mass: a wrong weight shows
    assert split_ready(q)
    got = split_attention(q, k, v, dim ** -0.5)
    whole = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(300, 4300), scale=dim ** -0.5,
                                                             enable_gqa=True)
    reference = math_part(q, k, v, dim ** -0.5, causal=True)[0]
    assert (got.float() - reference).abs().max() <= 2 * (whole.float() - reference).abs().max() + 1e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN and flash attention run on a GPU")
def test_scores_with_the_split_repetition_match_the_one_call(monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvweave.engine.importance import reconstruction_scores
    from conftest import CharTokenizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    net = LlamaForCausalLM(config).to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 512, (1, 700), generator=torch.Generator().manual_seed(0)).cuda()
    split = reconstruction_scores(net, CharTokenizer(), ids, chunk=256)
    monkeypatch.setattr(importance, "SPLIT_REPETITION", False)
    one = reconstruction_scores(net, CharTokenizer(), ids, chunk=256)
    finite = torch.isfinite(one)
    assert torch.equal(finite, torch.isfinite(split))
    torch.testing.assert_close(split[finite], one[finite], rtol=0.05, atol=2e-3)
