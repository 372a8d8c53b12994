"""Helpers shared by the cross-layer basis builders (``sketch-ema``, ``layer-share``).

- :func:`consecutive_windows` partitions layers ``0..L-1`` into windows ``[0..w-1], [w..2w-1], ...``
  (the last one may be shorter).
- :func:`randomized_top_right` is a batched randomized range finder (Halko, Martinsson & Tropp, 2011):
  for rows ``Y`` [..., m, C] it returns the top-``r`` right singular vectors ``P`` [..., r, C] (orthonormal
  rows) and singular values ``sigma`` [..., r]. When ``Y`` has fewer than ``r`` independent directions
  (e.g. a block of fewer than ``r`` rows), ``P`` is completed with random orthonormal rows whose
  singular value is 0, so ``P`` always has exactly ``r`` orthonormal rows.
- :func:`gram_top_right` is the same range finder run on the rows' Gram matrix ``Y^T Y`` [..., C, C] instead of
  the rows: the span ``(Y^T Y)^(q + 1) Omega`` of ``q`` power iterations, then a Rayleigh-Ritz step. One pass over
  the rows (the Gram matrix) where the range finder makes ``2 q + 2``, and every step after it on ``C x C`` matrices.
- :func:`ema_subspace` merges an old basis with a new one: the top-``r`` right singular vectors of
  ``[sqrt(ema) diag(sigma_old) P_old ; sqrt(1 - ema) diag(sigma_new) P_new]``, i.e. of the
  exponential moving average of the two rank-``r`` second-moment matrices ``P^T diag(sigma^2) P``.

All computation is on the input's device, float32 (float64 for the small Gram matrices of the
Cholesky QR and the final ``k x k`` eigenproblem). The Gaussian test matrices come from a CPU
``torch.Generator`` seeded by the caller and are shared by every leading (batch, head) index, so each
batch row's result depends only on that row's data.
"""

from __future__ import annotations

from kvweave.core.lazy import torch
from kvweave.core.linalg import cholesky_qr, rayleigh_ritz, seeded_gaussian, tall_product


def consecutive_windows(num_layers: int, window: int) -> list[tuple[int, ...]]:
    """``[(0..w-1), (w..2w-1), ...]`` covering ``0..num_layers-1``; the last window may be shorter."""
    return [tuple(range(start, min(start + window, num_layers))) for start in range(0, num_layers, window)]


def _gaussian(shape: tuple[int, ...], seed: int, device: torch.device) -> torch.Tensor:
    """The float32 Gaussian test matrix of ``seed`` on ``device`` (:func:`kvweave.core.linalg.seeded_gaussian`)."""
    return seeded_gaussian(shape, seed, device)


def _orthonormal_rows(rows: torch.Tensor) -> torch.Tensor:
    """Orthonormalize the rows of ``rows`` [..., k, C] (k <= C)."""
    q, _ = torch.linalg.qr(rows.transpose(-1, -2))
    return q.transpose(-1, -2)


def _complete(p: torch.Tensor, sigma: torch.Tensor, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Append ``rank - k`` random orthonormal rows (singular value 0) orthogonal to ``p`` [..., k, C]."""
    have, channels = p.shape[-2], p.shape[-1]
    if have >= rank:
        return p[..., :rank, :], sigma[..., :rank]
    extra = _gaussian((rank - have, channels), seed + 7919, p.device).expand(*p.shape[:-2], rank - have, channels)
    for _ in range(2):  # project out twice for numerical orthogonality
        extra = extra - (extra @ p.transpose(-1, -2)) @ p
    extra = _orthonormal_rows(extra)
    zeros = sigma.new_zeros(*sigma.shape[:-1], rank - have)
    return torch.cat((p, extra), dim=-2), torch.cat((sigma, zeros), dim=-1)


def randomized_top_right(
    rows: torch.Tensor, rank: int, oversample: int, power_iterations: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``rank`` right singular vectors of ``rows`` [..., m, C]: (P [..., rank, C], sigma [..., rank]).

    Requires ``rank <= C``. Sketch width ``k = min(rank + oversample, C)``; ``power_iterations`` rounds
    of ``Q <- orth(Y orth(Y^T Q))``; then the singular vectors of the small ``Q^T Y`` [..., k, C]. On a GPU
    (``k <= 32``) the orthonormalizations are Cholesky QR and the small SVD comes from the ``k x k``
    ``eigh`` of ``(Q^T Y)(Q^T Y)^T``, all batched over the leading dimensions (:func:`_range_finder_gram`);
    a block that makes them break down (fewer independent rows than ``k``, a zero block), and every
    block on a CPU, takes Householder QR and an SVD.
    """
    y = rows.float()
    channels = y.shape[-1]
    if rank > channels:
        raise ValueError(f"rank {rank} exceeds the channel width {channels}")
    k = min(rank + oversample, channels)
    omega = _gaussian((channels, k), seed, y.device)
    if y.is_cuda and y.shape[-2] >= k and k <= 32:  # on a CPU Householder QR is the faster one
        found = _range_finder_gram(y, omega, rank, power_iterations)
        if found is not None:
            return found
    q, _ = torch.linalg.qr(y @ omega)  # [..., m, min(m, k)]
    for _ in range(power_iterations):
        w, _ = torch.linalg.qr(y.transpose(-1, -2) @ q)  # [..., C, k']
        q, _ = torch.linalg.qr(y @ w)
    small = q.transpose(-1, -2) @ y  # [..., k', C]
    _, sigma, vh = torch.linalg.svd(small, full_matrices=False)
    return _complete(vh, sigma, rank, seed)


def _range_finder_gram(
    y: torch.Tensor, omega: torch.Tensor, rank: int, power_iterations: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`randomized_top_right` by Cholesky QR and a small ``eigh``; ``None`` where it breaks down."""
    # the steps need only their spans (one Cholesky round each); the last tall basis orthonormal (two rounds)
    q, ok = cholesky_qr(y @ omega, rounds=1 if power_iterations else 2)
    for step in range(power_iterations):
        w, w_ok = cholesky_qr(tall_product(y, q.float()), rounds=1)  # the long token axis summed in chunks on a GPU
        q, q_ok = cholesky_qr(y @ w.float(), rounds=2 if step == power_iterations - 1 else 1)
        ok &= w_ok & q_ok
    small = tall_product(q.float(), y).double()  # [..., k, C]
    values, vectors = torch.linalg.eigh(small @ small.transpose(-1, -2))  # ascending
    values, vectors = values.flip(-1)[..., :rank], vectors.flip(-1)[..., :rank]
    sigma = values.clamp_min(0).sqrt()
    # a direction with (numerically) no energy cannot be normalized: the general path completes it
    ok &= sigma[..., -1] > 1e-6 * sigma[..., 0].clamp_min(1e-30)
    if not bool(ok.all()):
        return None
    p = (vectors.transpose(-1, -2) @ small) / sigma.unsqueeze(-1)  # [..., rank, C], orthonormal rows
    return p.float(), sigma.float()


def gram_top_right(
    gram: torch.Tensor, rank: int, oversample: int, power_iterations: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`randomized_top_right` of rows ``Y`` [..., m, C] from their Gram matrix ``gram`` = ``Y^T Y`` [..., C, C]:
    ``(P [..., rank, C], sigma [..., rank])``, float32, or ``None`` where a Cholesky QR breaks down (fewer independent
    rows than the sketch's ``k = min(rank + oversample, C)`` columns: callers run the range finder on the rows).

    The same sketch (``Omega`` of ``seed``) and the same span as the range finder's ``power_iterations`` rounds,
    ``gram^(power_iterations + 1) Omega``, each step one Cholesky round in float64, the last two (CholeskyQR2); then
    the top eigenvectors of ``gram`` within that span (Rayleigh-Ritz), whose eigenvalues are ``sigma^2``. Vectors
    come from an ``eigh``: orthonormal whatever their energy, so a direction with none needs no completion."""
    channels = gram.shape[-1]
    if rank > channels:
        raise ValueError(f"rank {rank} exceeds the channel width {channels}")
    k = min(rank + oversample, channels)
    moment = gram.double()
    omega = _gaussian((channels, k), seed, gram.device).double()
    q, ok = cholesky_qr(moment @ omega, rounds=1)
    for _ in range(power_iterations):
        q, step_ok = cholesky_qr(moment @ q, rounds=1)
        ok &= step_ok
    q, step_ok = cholesky_qr(q, rounds=1)
    if not bool((ok & step_ok).all()):  # read before the small eigh, which refuses what is not finite
        return None
    vectors, values = rayleigh_ritz(moment, q, rank)
    return vectors.float(), values.clamp_min(0).sqrt().float()


def ema_subspace(
    p_old: torch.Tensor, sigma_old: torch.Tensor, p_new: torch.Tensor, sigma_new: torch.Tensor, ema: float, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-r right singular vectors of the EMA stack (see module docstring); shapes as the inputs."""
    rank = p_old.shape[-2]
    stacked = torch.cat(
        (
            (ema**0.5) * sigma_old.float().unsqueeze(-1) * p_old.float(),
            ((1.0 - ema) ** 0.5) * sigma_new.float().unsqueeze(-1) * p_new.float(),
        ),
        dim=-2,
    )
    _, sigma, vh = torch.linalg.svd(stacked, full_matrices=False)
    return _complete(vh, sigma, rank, seed)
