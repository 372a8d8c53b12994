"""Cross-layer basis builders: ``sketch-ema`` (both share modes, versioned EMA) and ``layer-share``.

The classes are used directly (not through the plugin catalog). Data is synthetic: low-rank signal
plus noise, shaped [G, B, H, n, D] as the engine passes it.
"""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.plugins.bases._sketch import randomized_top_right
from kvweave.plugins.bases.layer_share import LayerShareBasis
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis

G, B, H, D = 3, 2, 2, 8


def low_rank(n: int, rank: int = 4, noise: float = 0.05, seed: int = 0, g: int = G, b: int = B) -> torch.Tensor:
    """x [g, b, H, n, D]: per (b, h) a rank-``rank`` signal across all g*D channels, plus noise."""
    gen = torch.Generator().manual_seed(seed)
    factors = torch.randn(b, H, n, rank, generator=gen)
    mixing = torch.randn(b, H, rank, g * D, generator=gen)
    y = factors @ mixing + noise * torch.randn(b, H, n, g * D, generator=gen)
    return y.reshape(b, H, n, g, D).permute(3, 0, 1, 2, 4).contiguous()


def encode_all(basis: SketchEmaBasis, x: torch.Tensor) -> tuple[dict, torch.Tensor]:
    state = basis.init_state(x)
    return state, basis.encode(state, x)


def rel_err(basis: SketchEmaBasis, x: torch.Tensor) -> float:
    state, c = encode_all(basis, x)
    approx = torch.stack([basis.decode(state, c, m) for m in range(x.shape[0])])
    return float((approx - x).norm() / x.norm())


# ------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("share,rows", [("token-factor", 1), ("basis", G)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_shapes_and_shared_rows(share, rows, dtype):
    basis = SketchEmaBasis(window=G, rank=4, share=share)
    x = low_rank(10)
    state, c = encode_all(basis, x)
    assert c.shape == (rows, B, H, 10, 4) and basis.coefficient_rows(G) == rows
    for member in range(G):
        out = basis.decode(state, c.to(dtype), member)
        assert out.shape == (B, H, 10, D) and out.dtype == dtype
    channels = G * D if share == "token-factor" else D
    assert state["bases"].shape == (B, H, 1, 4, channels)


def test_layer_groups_are_consecutive_windows_with_a_short_last_one():
    shape = ModelShape(num_layers=10, num_query_heads=4, num_kv_heads=2, head_dim=D)
    expected = [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert SketchEmaBasis(window=4).layer_groups(shape) == expected
    assert LayerShareBasis(window=4).layer_groups(shape) == expected
    assert SketchEmaBasis(window=16).layer_groups(shape) == [tuple(range(10))]
    assert SketchEmaBasis(rank=5).coefficient_width(shape) == 5
    assert LayerShareBasis().coefficient_width(shape) == D


# ------------------------------------------------------------------------------------- accuracy
@pytest.mark.parametrize("share,full", [("token-factor", G * D), ("basis", D)])
def test_full_rank_reconstructs_to_float16_rounding(share, full):
    x = low_rank(40, rank=full, noise=1.0)
    assert rel_err(SketchEmaBasis(window=G, rank=full, share=share), x) < 1e-2


def test_sketch_beats_a_random_basis_and_nearly_matches_the_svd():
    x = low_rank(64, rank=4, noise=0.05)
    rank = 4
    err = rel_err(SketchEmaBasis(window=G, rank=rank), x)
    y = x.permute(1, 2, 3, 0, 4).reshape(B, H, 64, G * D)
    q, _ = torch.linalg.qr(torch.randn(G * D, rank, generator=torch.Generator().manual_seed(5)))
    random_err = float((y @ q @ q.T - y).norm() / y.norm())
    u, s, vh = torch.linalg.svd(y, full_matrices=False)
    optimal = float(((u[..., :rank] * s[..., None, :rank]) @ vh[..., :rank, :] - y).norm() / y.norm())
    assert err < 0.3 * random_err
    assert err < 1.05 * optimal + 1e-3


@pytest.mark.parametrize("share,ranks", [("token-factor", (1, 2, 4, 8, 16)), ("basis", (1, 2, 4, 6, 8))])
def test_error_decreases_as_rank_grows(share, ranks):
    x = low_rank(48, rank=6, noise=0.3, seed=3)
    errors = [rel_err(SketchEmaBasis(window=G, rank=r, share=share), x) for r in ranks]
    assert all(a > b for a, b in zip(errors, errors[1:])), errors


def test_a_block_with_fewer_tokens_than_rank_gets_orthonormal_rows_and_is_exact():
    x = low_rank(3, rank=3, noise=0.5)
    basis = SketchEmaBasis(window=G, rank=8)
    state, c = encode_all(basis, x)
    p = state["bases"][:, :, 0].float()
    eye = torch.eye(8).expand(B, H, 8, 8)
    assert torch.allclose(p @ p.transpose(-1, -2), eye, atol=3e-3)
    assert rel_err(basis, x) < 1e-2


def test_randomized_range_finder_rows_are_orthonormal_and_sorted():
    y = torch.randn(2, 3, 50, 20)
    p, sigma = randomized_top_right(y, 6, oversample=4, power_iterations=2, seed=1)
    assert p.shape == (2, 3, 6, 20) and sigma.shape == (2, 3, 6)
    assert torch.allclose(p @ p.transpose(-1, -2), torch.eye(6).expand(2, 3, 6, 6), atol=1e-4)
    assert torch.all(sigma[..., :-1] >= sigma[..., 1:])


def test_each_block_is_encoded_with_exactly_the_newest_stored_float16_basis():
    blocks = [low_rank(16, seed=s) for s in range(3)]
    basis = SketchEmaBasis(window=G, rank=4, ema=0.5, update_every=1)
    state, coeffs, versions = run_blocks(basis, blocks)
    assert versions == [1, 2, 3] and state["bases"].dtype == torch.float16
    for version, (x, c) in enumerate(zip(blocks, coeffs)):
        y = x.permute(1, 2, 3, 0, 4).reshape(B, H, 16, G * D)
        products = [y @ state["bases"][:, :, v].float().transpose(-1, -2) for v in range(3)]
        # the layers' products are summed one by one: float32 rounding apart from the one product, and far from the
        # products with the other versions
        torch.testing.assert_close(c[0], products[version], rtol=0, atol=1e-5)
        assert all((c[0] - products[v]).abs().max() > 1e-2 for v in range(3) if v != version)


@pytest.mark.parametrize("share", ["token-factor", "basis"])
def test_the_sketch_comes_from_the_gram_matrix_with_the_range_finders_subspace(share, monkeypatch):
    """A block with more rows than the sketch's columns is fitted from its Gram matrix, not by the range finder on the
    rows: the same subspace and singular values as that range finder's (same sketch, same power iterations)."""
    from kvweave.plugins.bases import sketch_ema

    x = low_rank(64, rank=4, noise=0.05, seed=2)
    basis = SketchEmaBasis(window=G, rank=4, share=share)
    reference = randomized_top_right(basis._rows(x, scaled=True), 4, basis.oversample, basis.power_iterations, basis.seed)

    def refuse(*_args, **_kwargs):
        raise AssertionError("the range finder on the rows was called")

    monkeypatch.setattr(sketch_ema, "randomized_top_right", refuse)
    state = basis.init_state(x)
    p, sigma = state["bases"][:, :, 0].float(), state["singular_values"]
    eye = torch.eye(4).expand(B, H, 4, 4)
    assert torch.allclose(p @ p.transpose(-1, -2), eye, atol=3e-3)
    projector = p.transpose(-1, -2) @ p
    expected = reference[0].transpose(-1, -2) @ reference[0]
    assert (projector - expected).abs().max() < 5e-3
    torch.testing.assert_close(sigma, reference[1], rtol=1e-3, atol=1e-5)
    assert torch.all(sigma[..., :-1] >= sigma[..., 1:])


def test_a_block_of_fewer_rows_than_the_sketch_or_without_energy_takes_the_range_finder(monkeypatch):
    """Fewer rows than ``rank + oversample``, or a zero block (the Gram steps break down): the range finder on the rows
    fits it, and its rows are orthonormal."""
    from kvweave.plugins.bases import sketch_ema

    calls = []
    real = sketch_ema.randomized_top_right
    monkeypatch.setattr(sketch_ema, "randomized_top_right", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    basis = SketchEmaBasis(window=G, rank=4)
    basis.init_state(low_rank(64))
    assert calls == []
    for x in (low_rank(10), torch.zeros(G, B, H, 64, D)):
        state = basis.init_state(x)
        p = state["bases"][:, :, 0].float()
        assert torch.allclose(p @ p.transpose(-1, -2), torch.eye(4).expand(B, H, 4, 4), atol=3e-3)
    assert calls == [(B, H, 10, G * D), (B, H, 64, G * D)]


def test_the_sketch_reads_a_16_bit_block_as_it_is_and_fits_what_its_float32_copy_fits():
    """``init_state`` takes the block in the model's dtype (``reads_block``): the state is that of its float32 copy."""
    x = low_rank(64).to(torch.bfloat16)
    basis = SketchEmaBasis(window=G, rank=4)
    assert SketchEmaBasis.reads_block
    native, copy = basis.init_state(x), basis.init_state(x.float())
    assert all(torch.equal(native[name], copy[name]) for name in copy)


# ------------------------------------------------------------------------------------- versions
def run_blocks(basis: SketchEmaBasis, blocks: list[torch.Tensor]) -> tuple[dict, list[torch.Tensor], list[int]]:
    state, coeffs, versions = None, [], []
    for block in blocks:
        if state is None:
            state = basis.init_state(block)
        coeffs.append(basis.encode(state, block))
        versions.append(state["bases"].shape[2])
    return state, coeffs, versions


@pytest.mark.parametrize("share", ["token-factor", "basis"])
def test_a_new_version_every_update_every_blocks_and_old_tokens_decode_bitwise_the_same(share):
    basis = SketchEmaBasis(window=G, rank=4, share=share, ema=0.5, update_every=2)
    blocks = [low_rank(6, seed=s) for s in range(5)]  # each block has its own subspace
    state, coeffs, versions = None, [], []
    before = None
    for index, block in enumerate(blocks):
        if state is None:
            state = basis.init_state(block)
        coeffs.append(basis.encode(state, block))
        versions.append(state["bases"].shape[2])
        if index == 1:
            before = [basis.decode(state, torch.cat(coeffs, dim=-2), m) for m in range(G)]
        if index == 2:
            after = [basis.decode(state, torch.cat(coeffs, dim=-2), m) for m in range(G)]
            for m in range(G):
                assert torch.equal(after[m][..., :12, :], before[m])
            assert not torch.equal(state["bases"][:, :, 0], state["bases"][:, :, 1])
    assert versions == [1, 1, 2, 2, 3]
    assert state["version_tokens"].tolist() == [[12, 12, 6]] * B
    assert state["version_tokens"].dtype == torch.int32
    # decoding a later range with ``start`` equals the same rows of the full decode
    full = torch.cat(coeffs, dim=-2)
    for m in range(G):
        whole = basis.decode(state, full, m)
        assert torch.equal(basis.decode(state, coeffs[2], m, start=12), whole[..., 12:18, :])
        assert torch.allclose(basis.decode(state, full[..., 10:20, :], m, start=10), whole[..., 10:20, :])
    with pytest.raises(CacheStateError):
        basis.decode(state, full, 0, start=1)


def test_versions_matter_old_tokens_with_the_new_basis_decode_differently():
    basis = SketchEmaBasis(window=G, rank=4, ema=0.3, update_every=1)
    state, coeffs, _ = run_blocks(basis, [low_rank(6, seed=1), low_rank(6, seed=2)])
    old = coeffs[0][0] @ state["bases"][:, :, 0, :, :D].float()
    new_basis = coeffs[0][0] @ state["bases"][:, :, 1, :, :D].float()
    decoded = basis.decode(state, torch.cat(coeffs, dim=-2), 0)[..., :6, :]
    assert torch.equal(decoded, old) and not torch.allclose(decoded, new_basis, atol=1e-2)


def test_ema_zero_never_adds_a_version():
    basis = SketchEmaBasis(window=G, rank=4, ema=0.0, update_every=1)
    state, _, versions = run_blocks(basis, [low_rank(5, seed=s) for s in range(4)])
    assert versions == [1, 1, 1, 1] and state["version_tokens"].tolist() == [[20]] * B


def test_ema_keeps_part_of_the_old_subspace():
    """After an update, the new basis still reconstructs the first block better than a fit of the second alone."""
    first, second = low_rank(32, seed=1, noise=0.01), low_rank(32, seed=2, noise=0.01)
    y1 = first.permute(1, 2, 3, 0, 4).reshape(B, H, 32, G * D)

    def error_on_first(p: torch.Tensor) -> float:
        return float((y1 @ p.transpose(-1, -2) @ p - y1).norm() / y1.norm())

    basis = SketchEmaBasis(window=G, rank=4, ema=0.7, update_every=1)
    state, _, versions = run_blocks(basis, [first, second])
    alone, _, _ = run_blocks(basis, [second])
    assert versions == [1, 2]
    assert error_on_first(state["bases"][:, :, -1].float()) < error_on_first(alone["bases"][:, :, -1].float())


# ------------------------------------------------------------------------------------- batch and bytes
@pytest.mark.parametrize("share", ["token-factor", "basis"])
def test_state_is_batch_first_and_rows_are_independent(share):
    basis = SketchEmaBasis(window=G, rank=4, share=share, ema=0.5, update_every=1)
    blocks = [low_rank(6, seed=s) for s in range(3)]
    state, coeffs, _ = run_blocks(basis, blocks)
    full = torch.cat(coeffs, dim=-2)
    swap = torch.tensor([1, 0])
    swapped = {name: t.index_select(0, swap) for name, t in state.items()}
    for m in range(G):
        ref = basis.decode(state, full, m)
        assert torch.equal(basis.decode(swapped, full.index_select(1, swap), m), ref.index_select(0, swap))
    # row 1 alone gives the same bases as in the batch (the sketch never mixes batch rows)
    alone, _, _ = run_blocks(basis, [b[:, 1:] for b in blocks])
    assert torch.allclose(alone["bases"].float(), state["bases"][1:].float(), atol=2e-3)


def test_state_bytes_are_small_and_compact():
    basis = SketchEmaBasis(window=G, rank=4, ema=0.5, update_every=1)
    state, _, _ = run_blocks(basis, [low_rank(64, seed=s) for s in range(2)])
    assert state["bases"].dtype == torch.float16 and state["singular_values"].dtype == torch.float32
    assert all(t.shape[0] == B for t in state.values())
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    versions = 2
    expected = B * H * versions * 4 * G * D * 2 + B * H * 4 * 4 + B * versions * 4 + B * 4 + B * 4
    assert nbytes == expected
    assert nbytes < 0.25 * (2 * 64 * B * H * G * D * 2)  # well under the 16-bit bytes of what it encodes


# ------------------------------------------------------------------------------------- layer-share
def test_layer_share_mean_and_first():
    x = low_rank(7, noise=1.0)
    for mode, expected in (("mean", x.mean(0)), ("first", x[0])):
        basis = LayerShareBasis(window=G, mode=mode)
        assert basis.init_state(x) == {}
        c = basis.encode({}, x)
        assert c.shape == (1, B, H, 7, D) and basis.coefficient_rows(G) == 1
        outs = [basis.decode({}, c.to(torch.bfloat16), m) for m in range(G)]
        assert all(torch.equal(o, outs[0]) for o in outs) and outs[0].dtype == torch.bfloat16
        assert torch.allclose(basis.decode({}, c, 1), expected, atol=1e-6)


# ------------------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "kwargs",
    [{"rank": 0}, {"share": "x"}, {"ema": 1.0}, {"ema": -0.1}, {"window": 0}, {"update_every": 0},
     {"oversample": -1}, {"rank": 2.5}, {"rank": True}],
)
def test_sketch_ema_rejects_bad_parameters(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        SketchEmaBasis(**kwargs)


@pytest.mark.parametrize("kwargs", [{"mode": "x"}, {"window": 0}])
def test_layer_share_rejects_bad_parameters(kwargs):
    with pytest.raises((ValueError, TypeError), match=next(iter(kwargs))):
        LayerShareBasis(**kwargs)


def test_check_model_limits_the_rank():
    even = ModelShape(num_layers=8, num_query_heads=4, num_kv_heads=2, head_dim=D)
    ragged = ModelShape(num_layers=10, num_query_heads=4, num_kv_heads=2, head_dim=D)
    SketchEmaBasis(window=4, rank=4 * D).check_model(even)
    with pytest.raises(ModelError, match="rank 33"):
        SketchEmaBasis(window=4, rank=4 * D + 1).check_model(even)
    with pytest.raises(ModelError, match="smallest window"):
        SketchEmaBasis(window=4, rank=2 * D + 1).check_model(ragged)  # last window has 2 layers
    SketchEmaBasis(window=4, rank=2 * D).check_model(ragged)
    SketchEmaBasis(window=4, rank=D, share="basis").check_model(even)
    with pytest.raises(ModelError, match="head_dim"):
        SketchEmaBasis(window=4, rank=D + 1, share="basis").check_model(even)
    LayerShareBasis(window=3).check_model(ragged)
