"""The ``salience`` router (token-adaptive precision tiers), the pooled key+value budget it uses, and the
warning a cache gives when it cannot meet its router's target."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvweave.core.errors import KvweaveError
from kvweave.core.interfaces import RouteBlock
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache
from kvweave.engine.budget import BudgetWarning
from kvweave.plugins.routers.salience import SalienceRouter, block_rank, outlier_score

from conftest import tiny_llama

TIERED = """
[pipelines.t-tiered]
extends = "prerope-k2v2-tiered"
[pipelines.t-tiered.router]
target_reduction = {target}
levels = [0, 16]
[pipelines.t-shares]
extends = "prerope-k2v2-tiered"
[pipelines.t-shares.router]
target_reduction = 0.0
levels = [0, 16]
shares = [0.25]
"""


def _block(vectors: torch.Tensor, kind: str = "keys", first: int = 100, budget=None, **fields) -> RouteBlock:
    return RouteBlock(layers=(0,), kind=kind, vectors=vectors, level_bytes={8: 10.0, 16: 20.0}, budget_bytes=budget, first=first, **fields)


def test_block_rank_orders_each_row_into_zero_to_one():
    x = torch.tensor([[3.0, -1.0, 7.0, 0.5], [1.0, 2.0, 3.0, 4.0]])
    assert block_rank(x).flatten().tolist() == pytest.approx([2 / 3, 0.0, 1.0, 1 / 3, 0.0, 1 / 3, 2 / 3, 1.0])


def test_a_token_far_from_its_block_has_the_highest_outlier_score():
    torch.manual_seed(0)
    vectors = torch.randn(1, 1, 1, 64, 16)
    vectors[..., 37, 5] = 40.0
    assert int(outlier_score(vectors).argmax()) == 37


def test_shares_set_how_many_tokens_get_each_level_and_the_best_scores_get_the_highest():
    torch.manual_seed(1)
    vectors = torch.randn(2, 1, 3, 40, 16)
    vectors[..., 11, :] *= 30  # one outlier token per head
    router = SalienceRouter(levels=(0, 8, 16), shares=(0.25, 0.05), attention=0.0, miss=0.0, sink_tokens=0)
    ranks = router.assign(_block(vectors))
    assert ranks.shape == vectors.shape[:-1]
    assert ((ranks == 16).sum(-1) == 2).all() and ((ranks == 8).sum(-1) == 10).all()  # round(0.05 * 40), round(0.25 * 40)
    assert (ranks[..., 11] == 16).all()


def test_sinks_come_first_and_only_at_the_start_of_the_sequence():
    vectors = torch.randn(1, 1, 2, 32, 16)
    router = SalienceRouter(levels=(0, 16), shares=(0.125,), sink_tokens=4, attention=0.0)
    at_start = router.assign(_block(vectors, first=0))
    assert (at_start[..., :4] == 16).all() and int((at_start == 16).sum()) == 2 * 4
    later = router.scores(_block(vectors, first=32))
    assert float(later.max()) <= 2.0  # two signals of weight 1, no sink bonus past the first tokens


def test_values_get_no_tier_when_the_router_tiers_keys():
    router = SalienceRouter(levels=(0, 16), shares=(0.5,), attention=0.0)
    assert int(router.assign(_block(torch.randn(1, 1, 1, 8, 16), kind="values")).sum()) == 0
    both = SalienceRouter(levels=(0, 16), shares=(0.5,), attention=0.0, kinds="both")
    assert int((both.assign(_block(torch.randn(1, 1, 1, 8, 16), kind="values")) == 16).sum()) == 4


def test_a_byte_budget_caps_the_tiered_tokens():
    router = SalienceRouter(levels=(0, 16), shares=(0.5,), attention=0.0)
    vectors = torch.randn(1, 1, 2, 50, 16)
    assert int((router.assign(_block(vectors, budget=20.0 * 7)) == 16).sum()) == 2 * 3  # 7 entries' bytes over 2 heads
    assert int((router.assign(_block(vectors, budget=1e9)) == 16).sum()) == 2 * 50  # budget beyond the block: every token
    assert int(router.assign(_block(vectors, budget=0.0)).sum()) == 0


@pytest.mark.parametrize("params, message", [
    (dict(levels=(0, 16), shares=(0.1, 0.1)), "one value per level"),
    (dict(levels=(0, 8, 16), shares=(0.7, 0.5)), "sum to more than 0 and at most 1"),
    (dict(levels=(0, 16), shares=(float("nan"),)), "finite"),
    (dict(levels=(16,)), "start at 0"),
    (dict(target_reduction=1.0), r"0 \(no budget\) or above 1"),
    (dict(kinds="queries"), "kinds"),
])
def test_bad_parameters_are_refused_with_the_parameter_named(params, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SalienceRouter(**params)


def test_a_level_above_head_dim_is_refused_at_build(tmp_path):
    registry = tmp_path / "r.toml"
    registry.write_text(TIERED.format(target=5.0).replace("levels = [0, 16]", "levels = [0, 64]", 1))
    with pytest.raises(KvweaveError, match="level 64 exceeds the model's head_dim 16"):
        build_cache(load_pipeline("t-tiered", registry), tiny_llama())


def _prefill(name, registry, dtype=torch.bfloat16, tokens=600):
    model = tiny_llama(dtype, layers=2)
    cache = build_cache(load_pipeline(name, registry), model)
    torch.manual_seed(4)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():
        warnings.simplefilter("always")
        model(input_ids=torch.randint(1, 128, (2, tokens)), cache=cache, use_cache=True)
    entries = sum(w.residuals[kind][16].entries for w in cache.engine.windows for kind in ("keys", "values"))
    value_entries = sum(w.residuals["values"][16].entries for w in cache.engine.windows)
    return cache, entries, value_entries, [w for w in caught if issubclass(w.category, BudgetWarning)]


def test_tiers_fill_one_budget_for_keys_and_values_and_the_target_is_met(tmp_path):
    registry = tmp_path / "r.toml"
    registry.write_text(TIERED.format(target=3.5))
    cache, entries, value_entries, warned = _prefill("t-tiered", registry)
    assert entries > 0 and value_entries == 0  # keys take the tiers, paid for by the values' unused half
    assert 3.5 * 0.999 <= cache.compression_ratio() < 3.5 * 1.05  # spent up to the target, not past it
    assert not warned


def test_without_a_target_the_shares_decide(tmp_path):
    registry = tmp_path / "r.toml"
    registry.write_text(TIERED.format(target=4.0))
    cache, entries, _, _ = _prefill("t-shares", registry)
    compressed = sum(w.compressed_tokens for w in cache.engine.windows) * 2 * 2  # batch 2, KV heads 2
    assert entries == round(0.25 * 64) * compressed // 64


def test_a_target_the_window_alone_exceeds_warns_once_naming_the_parts(tmp_path):
    registry = tmp_path / "r.toml"
    registry.write_text(TIERED.format(target=4.5))  # the coefficients reach 4.9x; a float32 window does not
    cache, entries, _, warned = _prefill("t-tiered", registry, dtype=torch.float32, tokens=300)
    assert entries == 0 and cache.compression_ratio() < 4.5
    assert len(warned) == 1
    message = str(warned[0].message)
    assert "target_reduction asks 4.5x" in message and "exact_window" in message and "float32" in message
