"""FreqDepthKV (seeds/002): the dct-depth basis, the head-mode router, the prefill-logit probe, the pipeline
and its ablations in the engine, on synthetic blocks and on a tiny random Llama (12 layers, head_dim 64)."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.engine import build_cache
from kvweave.core.errors import BudgetError, ModelError
from kvweave.engine.generation import generate
from kvweave.core.interfaces import ModelShape, RouteBlock
from kvweave.core.registry import load_pipeline
from kvweave.engine.residuals import encode_residuals, mix_residuals, residual_rows
from kvweave.plugins.bases.dct_depth import DctDepthBasis, dct_matrix
from kvweave.plugins.probes.prefill_logit import PrefillLogitProbe
from kvweave.plugins.quantizers.passthrough import NoQuantizer
from kvweave.plugins.routers.head_mode import HeadModeRouter, decide

from conftest import ToyTokenizer, record_route_blocks, tiny_llama
from helpers import build_test_cache, exact_cache, random_ids, random_inputs, run

ABLATIONS = ("average", "no-residuals", "shared-only", "static", "norm-loss", "no-exact", "b2", "b8")
PIPELINES = ("freqdepthkv",) + tuple(f"freqdepthkv-{name}" for name in ABLATIONS)


def shape(layers: int, head_dim: int = 64) -> ModelShape:
    return ModelShape(num_layers=layers, num_query_heads=4, num_kv_heads=2, head_dim=head_dim)


# ------------------------------------------------------------------------------------ the DCT basis
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_the_depth_dct_is_orthonormal_and_its_dc_row_is_constant(size):
    f = dct_matrix(size)
    assert torch.allclose(f @ f.T, torch.eye(size, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(f[0], torch.full((size,), size**-0.5, dtype=torch.float64))


@pytest.mark.parametrize("mode", ["dct", "average"])
@pytest.mark.parametrize("size", [2, 4])
def test_all_frequencies_restore_the_block_exactly(mode, size):
    torch.manual_seed(0)
    basis = DctDepthBasis(mode=mode)
    x = torch.randn(size, 2, 3, 10, 16)
    coefficients = basis.encode({}, x)
    assert coefficients.shape == (1, 2, 3, 10, 16) and basis.coefficient_rows(size) == 1
    approx = torch.stack([basis.decode({}, coefficients, m) for m in range(size)])
    assert torch.allclose(approx, x.mean(0, keepdim=True).expand_as(x), atol=1e-6)  # the DC term is the mean
    mixing = basis.residual_mixing(size)
    rows = residual_rows(x - approx, mixing)
    if mode == "dct":  # rows are the DCT coefficients Z_1.. (row 0: what the DC misses, here nothing)
        z = torch.einsum("kg,g...->k...", dct_matrix(size).float(), x)
        assert torch.allclose(rows[1:], z[1:], atol=1e-5) and rows[0].abs().max() < 1e-5
    full = torch.full((2, 3, 10), 16)
    lists = [encode_residuals(rows[k], full, NoQuantizer()) for k in range(size)]
    assert all("index" not in fields for entry in lists for fields in entry.values())  # full rank: no indices
    for m in range(size):
        if mixing is None:
            from kvweave.engine.residuals import add_residuals

            restored = add_residuals(approx[m], lists[m], NoQuantizer())
        else:
            restored = mix_residuals(approx[m], m, lists, NoQuantizer(), mixing)
        assert torch.allclose(restored, x[m], atol=1e-5)


def test_only_the_high_frequencies_restore_layers_up_to_the_dc():
    torch.manual_seed(1)
    basis = DctDepthBasis()
    x = torch.randn(4, 1, 2, 6, 8)
    approx = basis.decode({}, basis.encode({}, x), 0).expand(4, -1, -1, -1, -1)
    mixing = basis.residual_mixing(4)
    rows = residual_rows(x - approx, mixing)
    full = torch.full((1, 2, 6), 8)
    lists = [{} if k == 0 else encode_residuals(rows[k], full, NoQuantizer()) for k in range(4)]
    restored = torch.stack([mix_residuals(approx[m], m, lists, NoQuantizer(), mixing) for m in range(4)])
    assert torch.allclose(restored, x, atol=1e-5)  # the DC is exact here (no quantizer): Z_1..Z_3 suffice


def test_blocks_follow_the_paper_default_and_the_ablations():
    groups = DctDepthBasis().layer_groups(shape(30))
    assert [len(g) for g in groups] == [2, 2, 4, 4, 4, 4, 4, 2, 2, 2]
    assert [layer for g in groups for layer in g] == list(range(30))
    assert [len(g) for g in DctDepthBasis(block=2).layer_groups(shape(30))] == [2] * 15
    assert [len(g) for g in DctDepthBasis(block=8).layer_groups(shape(30))] == [2, 2, 8, 8, 6, 2, 2]
    assert [len(g) for g in DctDepthBasis(edge_layers=0).layer_groups(shape(12))] == [4, 4, 4]
    assert DctDepthBasis().layer_groups(shape(4)) == [(0, 1), (2, 3)]  # all four are edge layers


@pytest.mark.parametrize(
    "kwargs,layers,message",
    [
        ({}, 29, r"21 layers between the edges .* one layer over after blocks of 4"),
        ({"edge_block": 3}, 30, r"edge_block 3 does not divide edge_layers 4"),
        ({}, 7, r"7 layers all lie within the first or last edge_layers 4; blocks of edge_block 2 leave one layer over"),
    ],
)
def test_blocks_that_do_not_fit_the_model_are_refused(kwargs, layers, message):
    with pytest.raises(ModelError, match=message):
        DctDepthBasis(**kwargs).check_model(shape(layers))


def test_bad_parameters_name_what_is_wrong():
    with pytest.raises(ValueError, match="mode"):
        DctDepthBasis(mode="wavelet")
    with pytest.raises(ValueError, match="allow_exact"):
        HeadModeRouter(allow_exact=False, allow_residual=False)
    with pytest.raises(ValueError, match="residual_fractions"):
        HeadModeRouter(residual_fractions=[0.5, 0.25])
    with pytest.raises(ValueError, match="recent"):
        PrefillLogitProbe(recent=0.8, boundaries=0.5)
    with pytest.raises(ModelError, match="rank 64 exceeds the model's head_dim 16"):
        HeadModeRouter().check_model(shape(12, head_dim=16))


# ------------------------------------------------------------------------------------ the router
ROW_BYTES = 74.0  # an int8 row of 64 values + a float16 scale + row and token (int32)


def route_block(budget, errors_per_head, n=40, g=4, kind="keys", seed=0, queries=True):
    """A block whose decoded vectors miss by ``errors_per_head`` [H] (scaled noise), probe queries that see it."""
    gen = torch.Generator().manual_seed(seed)
    heads = len(errors_per_head)
    vectors = torch.randn(g, 1, heads, n, 64, generator=gen)
    noise = torch.randn(g, 1, heads, n, 64, generator=gen) * torch.tensor(errors_per_head).view(1, 1, heads, 1, 1)
    approx = vectors - noise
    basis = DctDepthBasis()
    mixing = basis.residual_mixing(g)
    extra = {}
    if queries:
        extra = dict(
            queries=torch.randn(g, 1, 2 * heads, 8, 64, generator=gen),
            query_positions=torch.full((g, 1, 8), n + 10, dtype=torch.int32),
            query_scale=0.125,
        )
    return RouteBlock(
        layers=tuple(range(g)), kind=kind, vectors=vectors, level_bytes={64: ROW_BYTES}, budget_bytes=budget,
        approx=approx, rows=residual_rows(vectors - approx, mixing), mixing=mixing, first=0, state={}, **extra,
    )


def routed_bytes(ranks):
    return float((ranks > 0).sum()) * ROW_BYTES


@pytest.mark.parametrize("budget", [0.0, 2000.0, 10000.0, 30000.0, 1e9])
def test_the_head_router_keeps_each_block_within_its_budget(budget):
    ranks = HeadModeRouter().assign(route_block(budget, [1.0, 0.2, 0.05]))
    assert ranks.shape == (4, 1, 3, 40) and set(ranks.unique().tolist()) <= {0, 64}
    assert routed_bytes(ranks) <= budget


def test_with_a_small_lambda_the_head_with_the_largest_loss_is_exact():
    router = HeadModeRouter()
    exact_one_head = 40 * 4 * ROW_BYTES
    block = route_block(exact_one_head, [0.01, 3.0, 0.01])
    ranks = router.assign(block)
    names = block.state["mode_names"]
    modes = [names[int(m)] for m in block.state["modes"][0]]
    assert modes[1] == "exact", modes
    assert bool((ranks[:, 0, 1] == 64).all())  # every row of every token of that head
    assert routed_bytes(ranks) <= exact_one_head


def test_residual_heads_keep_the_high_frequencies_of_their_most_perturbing_tokens():
    router = HeadModeRouter(allow_exact=False)
    block = route_block(8 * 3 * ROW_BYTES, [0.0, 1.0, 0.0])
    ranks = router.assign(block)
    assert bool((ranks[0] == 0).all())  # the DC row (constant column of the mixing) is never a residual row
    chosen = (ranks[1, 0, 1] > 0).nonzero().flatten()
    assert len(chosen) > 0 and bool((ranks[1:, 0, 1, chosen] == 64).all())
    errors, scores = router.token_errors(block)
    top = scores[0, 1].argsort(descending=True)[: len(chosen)]
    assert set(top.tolist()) == set(chosen.tolist())


def test_the_lambda_search_is_monotone_and_finds_the_smallest_lambda_that_fits():
    router = HeadModeRouter()
    block = route_block(None, [0.5, 1.0, 0.1, 2.0], n=64)
    table, _ = router.table(block, *router.token_errors(block))
    spent = []
    for lam in [0.0, 1e-3, 1e-2, 0.1, 1.0, 10.0, 100.0, 1e4, 1e6]:
        modes = (table.loss + lam * table.omega).argmin(-1)
        spent.append(float(table.cost[modes].sum()))
    assert all(a >= b for a, b in zip(spent, spent[1:])) and spent[0] > spent[-1] == 0.0
    budget = spent[0] / 3
    modes, lam = decide(table.loss, table.omega, table.cost, budget)
    assert float(table.cost[modes].sum()) <= budget
    below = (table.loss + lam * 0.999 * table.omega).argmin(-1)
    assert float(table.cost[below].sum()) > budget  # a slightly smaller lambda would not fit


def test_static_gives_every_head_of_a_block_the_same_mode():
    block = route_block(20000.0, [0.01, 3.0, 0.5])
    HeadModeRouter(static=True).assign(block)
    assert len(set(block.state["modes"].flatten().tolist())) == 1
    assert block.state["mode_names"][int(block.state["modes"][0, 0])] != "shared"


def test_the_logit_loss_without_queries_is_refused():
    with pytest.raises(ValueError, match="needs the model's queries"):
        HeadModeRouter().assign(route_block(1000.0, [1.0], queries=False))
    assert HeadModeRouter(loss="norm").assign(route_block(1000.0, [1.0], queries=False)).shape == (4, 1, 1, 40)


def test_the_norm_loss_ignores_the_queries_and_the_logit_loss_uses_them():
    block = route_block(None, [1.0, 1.0])
    other = attrs.evolve(block, queries=-block.queries * 3, state={})
    norm = HeadModeRouter(loss="norm")
    assert torch.equal(norm.token_errors(block)[0], norm.token_errors(other)[0])
    logit = HeadModeRouter()
    assert torch.allclose(logit.token_errors(block)[0] * 9, logit.token_errors(other)[0], rtol=1e-4)


# ------------------------------------------------------------------------------------ the probe
def test_the_probe_picks_recent_boundary_and_high_entropy_rows():
    torch.manual_seed(0)
    probe = PrefillLogitProbe(queries=16, recent=0.25, boundaries=0.25)
    new, d = 200, 8
    query = torch.randn(1, 4, new, d) * 6  # sharp attention rows ...
    flat = [37, 81, 122]
    query[:, :, flat] = 0.0  # ... except these: uniform attention, the highest entropy
    keys = torch.randn(1, 2, new, d)
    boundary = torch.zeros(1, new)
    boundary[0, [10, 50, 90, 150]] = 1
    picked = probe.select_queries(query, keys, boundary, None)[0].tolist()
    assert len(picked) == 16 == len(set(picked)) and picked == sorted(picked)
    assert set(range(196, 200)) <= set(picked)  # 4 recent
    assert len({10, 50, 90, 150} & set(picked)) == 4  # 4 boundaries
    assert set(flat) <= set(picked)  # the flat rows are among the high-entropy picks


# ------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.bfloat16, layers=12, hidden=256)


def _prompt(tokens=600):
    """The one-row prompt the engine tests here run (seed 1)."""
    return random_ids(1, tokens, seed=1)


def test_the_dc_is_stored_once_per_block(model):
    shared = run(model, build_test_cache("t-fdk-dc-none", model), _prompt())
    layers = run(model, build_test_cache("t-fdk-layers-none", model), _prompt())
    groups = len(shared.engine.groups)
    assert groups == 5  # 12 layers: 2 + 2 | 4 | 2 + 2
    assert shared.engine.view(0).packed_tokens == layers.engine.view(0).packed_tokens > 0
    coefficient = shared.memory_breakdown()["coefficients"]
    assert coefficient * 12 == layers.memory_breakdown()["coefficients"] * groups


def test_exact_heads_restore_the_cache_up_to_the_8bit_rows(model):
    ids = _prompt()
    cache = run(model, build_test_cache("t-fdk-exact", model), ids)
    for group in cache.engine.stores:
        state = group["keys"].route_state
        assert {state["mode_names"][int(m)] for m in state["modes"].flatten()} == {"exact"}
    truth = exact_cache(model, ids)
    packed = cache.engine.view(0).packed_tokens
    for layer in range(12):
        for kind in ("keys", "values"):
            restored = cache.engine.reconstruct(layer, kind, torch.float32)
            reference = getattr(truth.layers[layer], kind)[..., :packed, :].float()
            assert float((restored - reference).norm() / reference.norm()) < 2e-2, (layer, kind)


def test_freqdepthkv_meets_its_budget_and_beats_shared_only(model):
    errors, ratios = {}, {}
    for name in ("freqdepthkv", "freqdepthkv-shared-only"):
        ids = _prompt(2400)
        cache = run(model, build_test_cache(name, model), ids)
        ratios[name] = cache.compression_ratio()
        truth = exact_cache(model, ids)
        packed = cache.engine.view(0).packed_tokens
        squared = total = 0.0
        for layer in range(12):
            restored = cache.engine.reconstruct(layer, "keys", torch.float32)
            reference = truth.layers[layer].keys[..., :packed, :].float()
            squared += float((restored - reference).norm() ** 2)
            total += float(reference.norm() ** 2)
        errors[name] = (squared / total) ** 0.5
    assert 3.8 * 0.97 <= ratios["freqdepthkv"] <= 3.8 * 1.15, ratios
    assert ratios["freqdepthkv-shared-only"] > ratios["freqdepthkv"]
    assert errors["freqdepthkv"] < errors["freqdepthkv-shared-only"], errors


def test_values_follow_the_decision_made_on_keys(model):
    cache = run(model, build_test_cache("t-fdk", model), _prompt(900))
    stored = 0
    for window in cache.engine.views():
        (keys,), (values,) = ([r.located_fields() for r in kind.residuals if r.rank == 64] for kind in (window.keys, window.values))
        if keys:
            stored += keys["row"].numel()
            assert torch.equal(keys["row"], values["row"]) and torch.equal(keys["token"], values["token"])
    assert stored > 0


def test_the_prefill_probe_feeds_the_router_and_is_freed(model):
    cache = build_test_cache("t-fdk", model)
    seen = record_route_blocks(cache)
    run(model, cache, _prompt(600))
    prefill = seen[0]
    assert prefill.queries.shape[-2] == 32 and prefill.query_positions.shape == (2, 1, 32)  # the first block: 2 layers
    assert int(prefill.query_positions.max()) == 599  # the newest token is a probe position
    assert all(cache.engine.observer.probe_queries(layer)[0].shape[-2] == 4 for layer in range(12))  # recent only
    assert cache.memory_breakdown()["observation"] == cache.engine.observer.nbytes()


def test_head_modes_are_kept_while_decoding_unless_refreshed(model):
    decisions = {}
    for name in ("t-fdk", "t-fdk-refresh"):
        cache = run(model, build_test_cache(name, model), _prompt(600), decode=100)
        decisions[name] = cache.engine.stores[2]["keys"].route_state["decisions"]
    assert decisions["t-fdk-refresh"] >= 3 and decisions["t-fdk-refresh"] > decisions["t-fdk"]


def test_an_unreachable_budget_is_refused_when_the_cache_is_built(model):
    with pytest.raises(BudgetError, match=r"t-fdk-impossible.*10x.*at most [0-9.]+x"):
        build_test_cache("t-fdk-impossible", model)


def test_a_model_too_shallow_for_the_blocks_is_refused():
    with pytest.raises(ModelError, match="3 layers all lie within the first or last"):
        build_cache("freqdepthkv", tiny_llama(torch.bfloat16, layers=3, hidden=256), tokenizer=ToyTokenizer())


def test_every_ablation_is_one_swap_from_freqdepthkv():
    base = load_pipeline("freqdepthkv").to_dict()["slots"]
    swapped = {}
    for name in ABLATIONS:
        pipeline = load_pipeline(f"freqdepthkv-{name}")
        assert pipeline.chain == (f"freqdepthkv-{name}", "freqdepthkv", "full")
        changed = {slot for slot, cfg in pipeline.to_dict()["slots"].items() if cfg != base[slot]}
        assert len(changed) == 1, (name, changed)
        swapped[name] = changed.pop()
    assert swapped == {"average": "basis", "b2": "basis", "b8": "basis", "no-residuals": "router", "shared-only": "router",
                       "static": "router", "norm-loss": "router", "no-exact": "router"}


@pytest.mark.parametrize("name", PIPELINES)
def test_each_pipeline_generates_on_the_tiny_model(model, name):
    cache = build_test_cache(name, model)
    inputs = random_inputs(1, 500, seed=3)
    new, stats = generate(model, inputs, cache, max_new_tokens=40, do_sample=False, pad_token_id=0)
    assert new.shape == (1, 40) and stats.cached_tokens == 539
    assert stats.stored_bytes == cache.memory_bytes() and stats.ratio > 2.0
    state = cache.engine.stores[1]["keys"].route_state
    names = state.get("mode_names", ())
    used = {names[int(m)] for m in state["modes"].flatten()} if names else set()
    if name == "freqdepthkv-no-exact":
        assert "exact" not in names
    if name == "freqdepthkv-no-residuals":
        assert used <= {"shared", "exact"} and not any(n.startswith("residual") for n in names)


@pytest.mark.model
def test_kvweave_generate_runs_freqdepthkv_on_the_default_model(capsys):
    from kvweave.tools.cli import main

    code = main(["generate", "--pipeline", "freqdepthkv", "--prompt", "The harbour master wrote that the ships", "--max-new-tokens", "8", "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert code == 0 and "freqdepthkv" in out


def test_a_left_padded_batch_with_beams_runs_and_the_router_state_follows_the_beams(model):
    cache = build_test_cache("freqdepthkv", model)
    ids = random_ids(2, 450, seed=4)
    mask = torch.ones(2, 450, dtype=torch.long)
    ids[1, :60], mask[1, :60] = 0, 0  # the second row is 60 tokens shorter, left-padded
    new, stats = generate(model, {"input_ids": ids, "attention_mask": mask}, cache, max_new_tokens=40, do_sample=False,
                          num_beams=2, pad_token_id=0)
    assert new.shape == (2, 40) and stats.ratio > 2.0
    rows = cache.engine.rows.engines  # a left-padded batch is kept row by row (engine/rows.py)
    assert len(rows) == 4 and len({id(engine) for engine in rows}) == 4  # 2 rows x 2 beams, each its own copy
    for engine in rows:
        assert engine.stores[2]["keys"].route_state["modes"].shape == (1, 2)  # 2 KV heads
