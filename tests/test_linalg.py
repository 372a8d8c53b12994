"""Batched linear algebra for the prompt's compression (core/linalg.py) and the GPU paths that use it:
the sketch's Cholesky-QR range finder and the residual basis by subspace iteration. These paths are
chosen on CUDA tensors; here they are called directly and compared with the Householder QR / SVD /
eigh results the CPU path gives."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.linalg import cholesky_qr, subspace_eigenvectors, top_eigenvectors
from kvweave.plugins.bases._sketch import _gaussian, _range_finder_gram, randomized_top_right


def largest_angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest principal angle (degrees) between the row spaces of ``a`` and ``b`` [..., r, C] (orthonormal rows)."""
    cosines = torch.linalg.svdvals(a.double() @ b.double().transpose(-1, -2)).clamp(max=1.0)
    return float(torch.rad2deg(torch.arccos(cosines.min())))


def test_cholesky_qr_spans_the_same_columns_orthonormally():
    torch.manual_seed(0)
    a = torch.randn(3, 2, 500, 12) * torch.logspace(0, 2, 12)  # columns of very different scales
    q, ok = cholesky_qr(a)
    assert ok.all() and q.dtype == torch.float64
    assert torch.allclose(q.transpose(-1, -2) @ q, torch.eye(12, dtype=torch.float64), atol=1e-10)
    householder, _ = torch.linalg.qr(a.double())
    assert largest_angle(q.transpose(-1, -2), householder.transpose(-1, -2)) < 1e-4


def test_cholesky_qr_flags_rank_deficient_matrices():
    a = torch.randn(2, 40, 8)
    a[1, :, 5] = a[1, :, 2]  # the second matrix has rank 7
    _, ok = cholesky_qr(a)
    assert ok.tolist() == [True, False]


def test_top_eigenvectors_match_eigh_on_a_decaying_spectrum():
    torch.manual_seed(1)
    x = torch.randn(4, 3000, 128) * torch.linspace(3.0, 0.1, 128)
    moment = x.transpose(-1, -2) @ x
    vectors, values = top_eigenvectors(moment, 8)
    exact_values, exact_vectors = torch.linalg.eigh(moment.double())
    exact = exact_vectors.flip(-1)[..., :8].transpose(-1, -2)
    assert largest_angle(vectors, exact) < 1.0
    assert torch.allclose(values, exact_values.flip(-1)[..., :8], rtol=1e-4)
    assert torch.all(values[..., :-1] >= values[..., 1:])  # largest first
    assert torch.allclose(vectors @ vectors.transpose(-1, -2), torch.eye(8, dtype=torch.float64), atol=1e-8)


def test_top_eigenvectors_give_up_below_the_subspace_width():
    x = torch.randn(2, 10, 64)  # rank 10 < the 32 columns iterated
    assert top_eigenvectors(x.transpose(-1, -2) @ x, 8) is None


def test_gram_range_finder_equals_the_householder_one():
    torch.manual_seed(2)
    factors, mixing = torch.randn(2, 3, 4000, 12), torch.randn(2, 3, 12, 96)
    y = (factors @ mixing + 0.3 * torch.randn(2, 3, 4000, 96)) / 4000**0.5
    omega = _gaussian((96, 16), 5, y.device)
    fast = _range_finder_gram(y, omega, 8, 2)
    assert fast is not None
    p, sigma = fast
    p_ref, sigma_ref = randomized_top_right(y, 8, 8, 2, 5)  # CPU tensors: Householder QR and SVD
    assert torch.allclose(sigma, sigma_ref, rtol=1e-5)
    assert largest_angle(p, p_ref) < 0.1
    assert torch.allclose(p @ p.transpose(-1, -2), torch.eye(8), atol=1e-5)


def test_gram_range_finder_declines_a_block_with_too_few_directions():
    y = torch.randn(1, 2, 200, 3) @ torch.randn(1, 2, 3, 40)  # rank 3, sketch of 12 columns
    assert _range_finder_gram(y, _gaussian((40, 12), 0, y.device), 8, 2) is None


def sine_angle(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest principal angle (degrees) between the row spaces of ``a`` and ``b`` [..., r, C] (orthonormal rows), from
    its sine, which resolves angles far below what the arccos of a cosine near 1 can."""
    a, b = a.double(), b.double()
    outside = b - (b @ a.transpose(-1, -2)) @ a
    return float(torch.rad2deg(torch.arcsin(torch.linalg.matrix_norm(outside, ord=2).max().clamp(max=1.0))))


def test_one_cholesky_round_spans_the_columns_and_two_make_them_orthonormal():
    torch.manual_seed(3)
    a = torch.randn(2, 4000, 24, dtype=torch.float64) * torch.logspace(0, 3, 24, dtype=torch.float64)
    one, ok_one = cholesky_qr(a, rounds=1)
    two, ok_two = cholesky_qr(a, rounds=2)
    assert ok_one.all() and ok_two.all()
    eye = torch.eye(24, dtype=torch.float64)
    assert (one.transpose(-1, -2) @ one - eye).abs().max() < 1e-6
    assert (two.transpose(-1, -2) @ two - eye).abs().max() < 1e-13
    assert sine_angle(one.transpose(-1, -2), two.transpose(-1, -2)) < 1e-8  # the same span


@pytest.mark.parametrize("iterations", [10, 5, 0])
def test_subspace_iteration_by_squares_spans_what_single_powers_did(iterations):
    """``moment^2`` steps and one Cholesky round a step give the span of ``iterations + 1`` powers, as stepping by
    ``moment`` with two rounds a step did (written out here)."""
    torch.manual_seed(4)
    x = torch.randn(4, 3000, 128, dtype=torch.float64) * torch.linspace(3.0, 0.3, 128, dtype=torch.float64)
    moment = x.transpose(-1, -2) @ x
    vectors, values, ok = subspace_eigenvectors(moment, 8, iterations=iterations)
    assert ok.all()
    generator = torch.Generator(device="cpu").manual_seed(0)
    q = torch.randn(128, 32, generator=generator, dtype=torch.float64)
    for _ in range(iterations + 1):
        q, _ = cholesky_qr(moment @ q, rounds=2)
    small = q.transpose(-1, -2) @ moment @ q
    ref_values, ref_vectors = torch.linalg.eigh((small + small.transpose(-1, -2)) / 2)
    reference = (q @ ref_vectors.flip(-1)[..., :8]).transpose(-1, -2)
    assert sine_angle(vectors, reference) < 1e-6
    torch.testing.assert_close(values, ref_values.flip(-1)[..., :8], rtol=1e-10, atol=0)
