"""Depth-sharing and low-rank baselines as bases: ``minicache``, ``kvsharer``, ``eigen-lowrank``; each by the
property that defines it, on synthetic blocks and in the engine on a tiny random Llama (12 layers)."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.engine.generation import generate
from kvweave.core.interfaces import ModelShape
from kvweave.plugins.bases.eigen_lowrank import EigenLowRankBasis
from kvweave.plugins.bases.kvsharer import KVSharerBasis, dissimilar_pairs
from kvweave.plugins.bases.minicache import MiniCacheBasis, slerp

from conftest import tiny_llama
from helpers import build_test_cache, exact_cache, random_ids, random_inputs, run


def shape(layers: int, head_dim: int = 16) -> ModelShape:
    return ModelShape(num_layers=layers, num_query_heads=4, num_kv_heads=2, head_dim=head_dim)


# ------------------------------------------------------------------------------------ MiniCache
def test_minicache_pairs_layers_from_mid_depth():
    assert MiniCacheBasis().layer_groups(shape(8)) == [(0,), (1,), (2,), (3,), (4, 5), (6, 7)]
    assert MiniCacheBasis(start_layer=5).layer_groups(shape(8)) == [(0,), (1,), (2,), (3,), (4,), (5, 6), (7,)]
    with pytest.raises(ModelError, match="start_layer 7 leaves no pair"):
        MiniCacheBasis(start_layer=7).check_model(shape(8))


def test_slerp_stays_on_the_sphere_between_its_ends():
    torch.manual_seed(0)
    u, v = torch.nn.functional.normalize(torch.randn(2, 100, 8), dim=-1)
    for t in (0.0, 0.3, 0.5, 1.0):
        e = slerp(u, v, t)
        assert torch.allclose(e.norm(dim=-1), torch.ones(100), atol=1e-5)
        angle = torch.acos((u * v).sum(-1).clamp(-1, 1))
        to_u = torch.acos((e * u).sum(-1).clamp(-1, 1))
        assert torch.allclose(to_u, t * angle, atol=1e-3)


def test_merged_pair_keeps_magnitudes_and_retained_tokens_exactly():
    torch.manual_seed(1)
    basis = MiniCacheBasis(t=0.5, retain_angle=120.0)
    base = torch.randn(1, 2, 10, 16)
    x = torch.stack((base, base * 3 + 0.05 * torch.randn_like(base)))  # nearly parallel, different norms
    flipped = [2, 7]
    x[1, :, :, flipped] = -x[0, :, :, flipped]  # 180 degrees apart: retained
    state = basis.init_state(x)
    coefficients = basis.encode(state, x)
    assert coefficients.shape == (1, 1, 2, 10, 16) and state["retained_at"].tolist() == [flipped]
    for member in (0, 1):
        out = basis.decode(state, coefficients, member)
        assert torch.allclose(out.norm(dim=-1), x[member].norm(dim=-1), rtol=2e-3)  # each layer's own magnitude
        assert torch.allclose(out[:, :, flipped], x[member][:, :, flipped].half().float())  # exact up to float16
        merged = [t for t in range(10) if t not in flipped]
        assert float((out[:, :, merged] - x[member][:, :, merged]).norm() / x[member][:, :, merged].norm()) < 0.05
    later = basis.encode(state, x)  # a second block: its retained tokens are numbered after the first's
    assert state["retained_at"].tolist() == [flipped + [t + 10 for t in flipped]]
    assert torch.equal(basis.decode(state, later, 1, start=10), basis.decode(state, coefficients, 1))


# ------------------------------------------------------------------------------------ KVSharer
def test_kvsharer_pairs_the_most_dissimilar_layers_first():
    means = torch.tensor([[0.0], [0.1], [5.0], [5.2], [0.2], [9.0]])
    source_of = dissimilar_pairs(means, 2)
    # 0-5 is the farthest pair (5 reuses 0); 1-5 and 4-5 are skipped (5 already shares); next 0-3 (5.2)
    assert source_of == {5: 0, 3: 0}
    assert all(source not in source_of for source in source_of.values())
    with pytest.raises(ModelError, match=r"4 sharing layers \(share_layers 4, .*exceed half"):
        KVSharerBasis(share_layers=4).check_model(shape(6))
    assert KVSharerBasis().sharing(30) == 8 and KVSharerBasis().sharing(4) == 1  # a quarter by default


def test_kvsharer_layers_that_share_decode_their_source():
    torch.manual_seed(2)
    x = torch.randn(6, 1, 2, 12, 16) + torch.arange(6.0).view(6, 1, 1, 1, 1) * torch.tensor([0, 0, 1, 1, 0, 3.0]).view(6, 1, 1, 1, 1)
    basis = KVSharerBasis(share_layers=2)
    state = basis.init_state(x)
    coefficients = basis.encode(state, x)
    assert coefficients.shape[0] == 4 == basis.coefficient_rows(6)
    rows = state["row"][0].tolist()
    sharing = [layer for layer in range(6) if layer not in basis.stored_layers(state)]
    assert len(sharing) == 2
    for layer in range(6):
        source = basis.stored_layers(state)[rows[layer]]
        assert torch.equal(basis.decode(state, coefficients, layer), x[source])
        if layer not in sharing:
            assert source == layer


# ------------------------------------------------------------------------------------ Eigen
def test_eigen_error_decreases_with_rank_and_full_rank_is_exact():
    torch.manual_seed(3)
    x = (torch.randn(1, 2, 2, 50, 4) @ torch.randn(4, 16)) + 0.3 * torch.randn(1, 2, 2, 50, 16)
    errors = []
    for rank in (1, 2, 4, 8, 16):
        basis = EigenLowRankBasis(rank=rank, basis_dtype="float32")
        state = basis.init_state(x)
        out = basis.decode(state, basis.encode(state, x), 0)
        errors.append(float((out - x[0]).norm() / x[0].norm()))
    assert all(a > b for a, b in zip(errors, errors[1:])), errors
    assert errors[-1] < 1e-5
    with pytest.raises(ModelError, match="rank 32 exceeds the model's head_dim 16"):
        EigenLowRankBasis(rank=32).check_model(shape(4))


# ------------------------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.bfloat16, layers=12, hidden=256)


def _prompt():
    """The 400-token prompt the engine tests here prefill (seed 1)."""
    return random_ids(1, 400, seed=1)


def test_minicache_merged_layers_share_storage(model):
    ids = _prompt()
    cache = run(model, build_test_cache("minicache", model), ids)
    engine = cache.engine
    pair = next(i for i, g in enumerate(engine.groups) if len(g) == 2)
    single = next(i for i, g in enumerate(engine.groups) if len(g) == 1)

    def group_bytes(index):
        return sum(s.coefficients.nbytes() + sum(t.untyped_storage().nbytes() for t in (s.state or {}).values())
                   for s in engine.stores[index].values())

    assert group_bytes(pair) < 2 * group_bytes(single)
    truth = exact_cache(model, ids)
    state = engine.stores[pair]["keys"].state
    layer = engine.groups[pair][1]
    restored = engine.reconstruct(layer, "keys", torch.float32)
    for position in state["retained_at"][0].tolist():
        assert torch.allclose(restored[0, :, position], truth.layers[layer].keys[0, :, position].float())


def test_kvsharer_sharing_layers_add_no_bytes_and_decode_their_source(model):
    ids = _prompt()
    shared = run(model, build_test_cache("t-kvsharer", model), ids)
    plain = run(model, build_test_cache("t-kvsharer-none", model), ids)
    coefficients = shared.memory_breakdown()["coefficients"]
    assert coefficients * 12 == plain.memory_breakdown()["coefficients"] * 8  # 4 of 12 layers store nothing
    truth = exact_cache(model, ids)
    state = shared.engine.stores[0]["keys"].state
    basis = shared.engine.basis
    stored = basis.stored_layers(state)
    sharing = [layer for layer in range(12) if layer not in stored]
    assert len(sharing) == 4
    packed = shared.engine.view(0).packed_tokens
    for layer in sharing:
        source = stored[int(state["row"][0, layer])]
        restored = shared.engine.reconstruct(layer, "keys", torch.bfloat16)
        assert torch.equal(restored, truth.layers[source].keys[..., :packed, :])


def test_eigen_lowrank_full_rank_is_exact_and_a_lower_rank_is_not(model):
    errors = {}
    for name in ("t-eigen-full", "t-eigen-8"):
        ids = _prompt()
        cache = run(model, build_test_cache(name, model), ids)
        truth = exact_cache(model, ids)
        packed = cache.engine.view(0).packed_tokens
        restored = cache.engine.reconstruct(3, "values", torch.float32)
        reference = truth.layers[3].values[..., :packed, :].float()
        errors[name] = float((restored - reference).norm() / reference.norm())
    assert errors["t-eigen-full"] < 1e-2 < errors["t-eigen-8"]


@pytest.mark.parametrize("name", ["minicache", "t-kvsharer", "eigen-lowrank"])
def test_each_baseline_generates_on_the_tiny_model(model, name):
    cache = build_test_cache(name, model)
    inputs = random_inputs(1, 300, seed=3)
    new, stats = generate(model, inputs, cache, max_new_tokens=70, do_sample=False, pad_token_id=0)
    assert new.shape == (1, 70) and stats.cached_tokens == 369
    assert stats.stored_bytes == cache.memory_bytes() and stats.ratio > 1.0
    assert cache.engine.view(0).packed_tokens == 256  # compression went on during decoding
