"""DepthWeave-KV's components in the engine: budgeted multi-level routing, probes, gates, budgets that
cannot be met, and the cache's bookkeeping with a real basis."""

from __future__ import annotations

import pytest
import torch

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache
from kvweave.core.errors import BudgetError, CacheStateError
from kvweave.core.interfaces import RouteBlock
from kvweave.core.registry import load_pipeline
from kvweave.plugins.probes.attention_output import AttentionOutputProbe
from kvweave.plugins.routers.sigmoid_multilevel import SigmoidMultilevelRouter, budget_shift

from conftest import record_route_blocks, tiny_llama
from helpers import build_test_cache, exact_cache, random_ids, run
from test_graphs_warm import _HostReads


LEVEL_BYTES = {2: 11.0, 4: 15.0, 8: 24.0}


def _block(budget=None, boundary=None, seed=0):
    torch.manual_seed(seed)
    vectors = torch.randn(2, 1, 2, 40, 16)
    return RouteBlock(
        layers=(0, 1), kind="keys", vectors=vectors, level_bytes=LEVEL_BYTES, budget_bytes=budget,
        attention_mass=torch.rand(2, 1, 2, 40), attention_spike=torch.rand(2, 1, 2, 40),
        boundary=boundary, probe_error=torch.zeros(2, 2), miss=torch.rand(2, 1, 2, 40),
    )


def _bytes(ranks):
    return sum(LEVEL_BYTES[r] * int((ranks == r).sum()) for r in LEVEL_BYTES)


@pytest.mark.parametrize("budget", [0.0, 100.0, 600.0, 1500.0])
def test_the_router_keeps_each_block_within_its_byte_budget(budget):
    ranks = SigmoidMultilevelRouter().assign(_block(budget))
    assert ranks.shape == (2, 1, 2, 40)
    assert _bytes(ranks) <= budget
    assert set(ranks.unique().tolist()) <= {0, 2, 4, 8}


def _bisected_levels(scores, thresholds, cost, budget):
    """The levels a bisection over the shift finds (what the router did before it sorted the crossings)."""
    def count(delta):
        return (scores.unsqueeze(-1) > thresholds + delta).sum(dim=-1)

    if float(cost[count(-1.0)].sum()) <= budget:
        return count(-1.0)
    low, high = -1.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if float(cost[count(middle)].sum()) > budget else (low, middle)
    return count(high)


@pytest.mark.parametrize("seed", range(6))
def test_the_budget_shift_found_by_sorting_gives_the_bisections_levels_with_no_host_read(seed):
    """The shift that fits a block's residual budget, from the sorted crossings on the device: the same levels as a
    bisection over the shift (ties in the scores included), within the budget, and no tensor read to the host
    (``item``, ``float``, ``tolist``, ...) on the way: a GPU's flush does not wait on it."""
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(4, 2, 8, 32, generator=generator)
    scores[0, 0, 0, :8] = scores[0, 0, 0, 8]  # tied scores
    thresholds = torch.linspace(0, 1, 5)[1:-1]
    cost = [0.0, 3.0, 7.0, 12.0 + seed]
    over = scores.unsqueeze(-1) - thresholds
    for budget in (0.0, 50.0, 1000.0 * (seed + 1), 1e9):
        with _HostReads(()) as mode:
            levels = (over > budget_shift(over, cost, budget)).sum(dim=-1)
        assert not mode.sites, dict(mode.sites)
        assert torch.equal(levels, _bisected_levels(scores, thresholds, torch.tensor(cost), budget))
        assert float(torch.tensor(cost)[levels].sum()) <= budget
    with pytest.raises(ValueError, match="non-decreasing"):
        budget_shift(over, [0.0, 5.0, 4.0, 9.0], 100.0)


def test_a_larger_budget_promotes_more_and_higher_scores_get_higher_levels():
    router = SigmoidMultilevelRouter()
    block = _block(400.0)
    small, large = router.assign(block), router.assign(_block(1200.0))
    assert _bytes(large) > _bytes(small) and _bytes(large) <= 1200.0
    scores = router.scores(block).flatten()
    ranks = small.flatten()
    order = scores.argsort()
    assert torch.all(ranks[order][1:] >= ranks[order][:-1])  # monotone in the score


def test_delimiters_raise_the_score():
    router = SigmoidMultilevelRouter()
    boundary = torch.zeros(1, 40)
    boundary[0, ::5] = 1
    with_flags = router.scores(_block(boundary=boundary))
    without = router.scores(_block(boundary=torch.zeros(1, 40)))
    assert torch.all(with_flags[..., ::5] > without[..., ::5])
    assert torch.equal(with_flags[..., 1::5], without[..., 1::5])


def test_random_scoring_ignores_the_token_but_spends_the_same_budget():
    router = SigmoidMultilevelRouter(scoring="random")
    a = router.assign(_block(900.0, seed=0))
    b = router.assign(_block(900.0, seed=1))  # other vectors and features, same shape and layers
    assert torch.equal(a, b)
    assert 0 < _bytes(a) <= 900.0
    assert not router.needs_attention and not router.needs_boundaries


def test_router_parameters_are_validated():
    for bad in ({"levels": [2, 4]}, {"levels": [0, 4, 2]}, {"target_reduction": 0.5}, {"scoring": "psychic"}, {"weights": "/no/file.json"}):
        with pytest.raises((TypeError, ValueError)):
            SigmoidMultilevelRouter(**bad)


def test_the_probe_measures_eq3_and_moves_the_share():
    probe = AttentionOutputProbe(tolerance=0.05, patience=2, step=0.5)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    ctx_k, ctx_v = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    assert torch.allclose(probe.measure(q, k, v, k, v, ctx_k, ctx_v), torch.zeros(2), atol=1e-6)
    noisy = probe.measure(q, k, v, k + 0.5 * torch.randn_like(k), v, ctx_k, ctx_v)
    assert noisy.shape == (2,) and bool((noisy > 0.01).all())
    state: dict = {}
    assert probe.adjust(1.0, torch.tensor([[0.2]]), state) == 1.5  # above tolerance: more budget
    share = probe.adjust(1.5, torch.tensor([[0.01]]), state)
    assert share == 1.5  # one calm probe is not enough
    assert probe.adjust(share, torch.tensor([[0.01]]), state) == 1.0  # after `patience` calm probes


def _prompt(tokens=2000):
    """The 2-row prompt every engine test here runs (seed 1)."""
    return random_ids(2, tokens, seed=1)


def test_depthweave_meets_its_budget_counting_every_tensor():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    cache = run(model, build_test_cache("t-dw", model), _prompt(), decode=70)
    parts = cache.memory_breakdown()
    assert all(parts[p] > 0 for p in ("exact_window", "coefficients", "residuals", "basis_state", "observation"))
    ratio = cache.compression_ratio()
    assert 8.5 * 0.9 <= ratio <= 8.5 * 1.25, (ratio, parts)
    assert model.config._attn_implementation == "kvweave-observe"
    # compression went on during decoding: versions were added and every layer compressed the same tokens
    assert cache.engine.stores[0]["keys"].state["bases"].shape[2] > 1
    assert len({w.packed_tokens for w in cache.engine.views()}) == 1


def test_reconstruction_of_depthweave_is_closer_with_residuals():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    errors = {}
    for name, pipeline in (("routed", "t-dw"), ("bases-only", "t-dw-bases")):
        cache = run(model, build_test_cache(pipeline, model), _prompt())
        reference = tiny_llama(torch.bfloat16, layers=4, hidden=256)  # a fresh copy: same seed, same weights
        exact = exact_cache(reference, _prompt())
        packed = cache.engine.view(0).packed_tokens
        squared = total = 0.0
        for layer in range(4):
            for kind in ("keys", "values"):
                restored = cache.engine.reconstruct(layer, kind, torch.float32)
                truth = getattr(exact.layers[layer], kind)[..., :packed, :].float()
                squared += float((restored - truth).norm() ** 2)
                total += float(truth.norm() ** 2)
        errors[name] = (squared / total) ** 0.5
    assert errors["routed"] < errors["bases-only"]


def test_an_impossible_budget_is_refused_when_the_cache_is_built():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    with pytest.raises(BudgetError, match=r"t-dw-impossible.*100x.*at most [0-9.]+x"):
        build_test_cache("t-dw-impossible", model)


def test_delimiter_features_need_a_tokenizer():
    with pytest.raises(CacheStateError, match="tokenizer"):
        build_cache("depthweave-kv", tiny_llama(torch.bfloat16, layers=4, hidden=256))


def test_a_cache_not_bound_to_its_model_refuses_to_go_on_silently():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    cache = KVWeaveCache(load_pipeline("depthweave-kv-no-router"), model.config)  # needs queries for its probe
    with pytest.raises(CacheStateError, match="did not report"):
        run(model, cache, _prompt(300), decode=2)


def test_every_ablation_is_one_swap_from_depthweave():
    base = load_pipeline("depthweave-kv").to_dict()["slots"]
    for name in ("no-cross-depth", "no-router", "no-probe", "no-gates", "bases-only", "layer-share", "reference-kernel"):
        pipeline = load_pipeline(f"depthweave-kv-{name}")
        assert pipeline.chain == (f"depthweave-kv-{name}", "depthweave-kv", "full")
        changed = {slot for slot, cfg in pipeline.to_dict()["slots"].items() if cfg != base[slot]}
        if "kernel" in changed and name != "reference-kernel":  # a basis the fused kernel cannot read
            assert pipeline.slots["kernel"].use == "reference", name
            changed.discard("kernel")
        assert len(changed) <= 2, (name, changed)  # one component (plus its quantizer where widths change)


def test_a_later_forward_with_another_cache_leaves_the_compressed_one_alone():
    from transformers import DynamicCache

    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    cache = run(model, build_test_cache("t-dw", model), _prompt(400), decode=1)
    before, queries = cache.memory_bytes(), cache.engine.observer.queries(0).clone()
    ids = torch.randint(1, 128, (2, 50))
    with torch.inference_mode():
        observed = model(input_ids=ids, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config))).logits
        model.set_attn_implementation("sdpa")
        plain = model(input_ids=ids, use_cache=True, **cache_kwargs(model, DynamicCache(config=model.config))).logits
    assert cache.memory_bytes() == before and torch.equal(cache.engine.observer.queries(0), queries)
    assert torch.equal(observed, plain)


def test_the_shipped_router_weights_load_by_name():
    router = SigmoidMultilevelRouter(weights="builtin:smollm2-135m-depthweave-kv")
    assert router.gates(0, "keys").shape == (3,)
    with pytest.raises(ValueError, match="shipped: smollm2-135m-depthweave-kv"):
        SigmoidMultilevelRouter(weights="builtin:nope")


def test_residuals_on_a_per_layer_basis_store_no_indices_and_keep_the_budget():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    cache = run(model, build_test_cache("t-dw-rb", model), _prompt())
    window = cache.engine.views()[0]
    assert window.keys.residual_basis.shape == (2, 2, 8, 64)  # [B, H, largest level, D]
    stored = [r.fields for r in window.keys.residuals if r.entries]
    assert stored and all("index" not in fields for fields in stored)
    assert 8.5 * 0.9 <= cache.compression_ratio() <= 8.5 * 1.25


def test_a_full_rank_residual_basis_restores_the_residual():
    from kvweave.engine.residuals import add_residuals, encode_residuals, fit_residual_basis
    from kvweave.plugins.quantizers.passthrough import NoQuantizer

    torch.manual_seed(0)
    missing = torch.randn(1, 2, 30, 8)
    basis = fit_residual_basis(missing, 8)
    ranks = torch.full((1, 2, 30), 8)
    entries = encode_residuals(missing, ranks, NoQuantizer(), basis)
    restored = add_residuals(torch.zeros_like(missing), entries, NoQuantizer(), basis=basis)
    assert torch.allclose(restored, missing, atol=2e-2)  # float16 basis
    partial = add_residuals(torch.zeros_like(missing), encode_residuals(missing, torch.full((1, 2, 30), 2), NoQuantizer(), basis), NoQuantizer(), basis=basis)
    assert (missing - partial).norm() < missing.norm()  # the first coordinates already help


def test_entries_on_a_residual_basis_hold_their_own_tokens_first_coordinates():
    """Levels 2, 4 and 8 mixed over rows and tokens: each entry's values are its (row, token)'s first ``rank``
    coordinates on the row's basis (to float32 rounding), whichever way they are selected from the block's coordinates."""
    from kvweave.engine.residuals import encode_residuals, fit_residual_basis
    from kvweave.plugins.quantizers.passthrough import NoQuantizer

    gen = torch.Generator().manual_seed(4)
    missing = torch.randn(2, 3, 50, 16, generator=gen)
    basis = fit_residual_basis(missing, 8)
    ranks = torch.tensor([0, 2, 4, 8])[torch.randint(0, 4, (2, 3, 50), generator=gen)]
    coordinates = torch.einsum("bhnd,bhkd->bhnk", missing, basis.float()).reshape(6, 50, 8)
    entries = encode_residuals(missing, ranks, NoQuantizer(), basis)
    assert sorted(entries) == [2, 4, 8]
    for rank, fields in entries.items():
        row, token = fields["row"].long(), fields["token"].long()
        assert torch.equal(ranks.reshape(6, 50)[row, token], torch.full_like(row, rank))
        assert int((ranks == rank).sum()) == row.numel()
        # to float32 rounding: the coordinates come from another product's order of sums (bit-equal on some CPUs, a unit
        # in the last place apart on others, e.g. an AMD EPYC); another token's or rank's coordinates are O(1) away
        assert torch.allclose(NoQuantizer().dequantize({k[2:]: v for k, v in fields.items() if k.startswith("q_")},
                                                       torch.float32), coordinates[row, token, :rank], rtol=0, atol=1e-5)
    # the entries as the kernels read them: each field contiguous, one entry after another, whatever the quantizer
    from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer

    for quantizer in (NoQuantizer(), Int4GroupQuantizer(group=2)):
        for fields in encode_residuals(missing, ranks, quantizer, basis).values():
            assert all(t.is_contiguous() for t in fields.values()), {k: t.stride() for k, t in fields.items()}


def test_keys_and_values_of_a_block_are_routed_on_the_same_attention_statistics():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)
    cache = build_test_cache("t-dw", model)
    seen = record_route_blocks(cache)
    run(model, cache, _prompt(600))
    keys, values = seen[0], seen[1]
    assert (keys.kind, values.kind) == ("keys", "values")
    assert torch.equal(keys.attention_mass, values.attention_mass)
    # probabilities of the observed queries: each query spends at most 1 on the block
    observed = cache.engine.observer.queries(0).shape[-2] * 2  # 2 query heads per KV head
    assert float(keys.attention_mass.sum(dim=-1).max()) <= observed + 1e-4
