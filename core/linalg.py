"""Small batched linear algebra that stays fast on a GPU: what the prompt's compression needs.

On CUDA, ``torch.linalg.qr`` of tall matrices, ``eigh`` of matrices above 32 x 32 and ``svd`` run one
cuSOLVER call per matrix of the batch (8 heads x 4 layers x 2 kinds per window: milliseconds each), while
Cholesky factorizations, triangular solves and ``eigh`` of matrices up to 32 x 32 run batched. The
functions here are built from those:

- :func:`cholesky_qr`: orthonormal columns of a tall ``A`` (CholeskyQR2, float64 Gram matrices), with a
  flag per matrix saying whether it worked (a rank-deficient ``A`` fails: callers fall back);
- :func:`top_eigenvectors`: the top eigenvectors of symmetric PSD matrices by subspace iteration with a
  Rayleigh-Ritz step on a <= 32 x 32 matrix; :func:`subspace_eigenvectors` the same without reading whether it
  worked (no host read: the caller reads the flag where it reads the host anyway).
"""

from __future__ import annotations

from kvweave.core.lazy import torch


def cholesky_qr(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, ok)``: ``Q`` [..., m, k] (float64) with orthonormal columns spanning those of ``a`` [..., m, k]
    (``m >= k``), by two rounds of ``Q = A R^-1`` with ``R^T R = A^T A``; ``ok`` [...] is false where a
    Cholesky factorization failed or the result is not finite (then ``Q`` is meaningless there)."""
    q = a.double()
    ok = torch.ones(a.shape[:-2], dtype=torch.bool, device=a.device)
    for _ in range(2):
        gram = q.transpose(-1, -2) @ q
        factor, info = torch.linalg.cholesky_ex(gram)
        ok &= info == 0
        q = torch.linalg.solve_triangular(factor, q.transpose(-1, -2), upper=False).transpose(-1, -2)
    ok &= torch.isfinite(q).all(dim=-1).all(dim=-1)
    return q, ok


def subspace_eigenvectors(
    moment: torch.Tensor, rank: int, *, extra: int = 24, iterations: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """:func:`top_eigenvectors` without the host read: ``(vectors, values, ok)``, ``ok`` [...] false for each matrix
    whose iteration broke down (its vectors are then meaningless); ``None`` only where ``rank`` exceeds the subspace's
    width."""
    dim = moment.shape[-1]
    width = min(rank + extra, 32, dim)
    if width < rank:
        return None
    m = moment.double()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(dim, width, generator=generator, dtype=torch.float64).to(m.device)
    q, ok = cholesky_qr(m @ q)
    for _ in range(iterations):
        q, step_ok = cholesky_qr(m @ q)
        ok &= step_ok
    small = q.transpose(-1, -2) @ m @ q  # [..., width, width]
    values, vectors = torch.linalg.eigh((small + small.transpose(-1, -2)) / 2)  # ascending
    top = vectors.flip(-1)[..., :rank]  # [..., width, rank], largest first
    return (q @ top).transpose(-1, -2), values.flip(-1)[..., :rank], ok


def top_eigenvectors(
    moment: torch.Tensor, rank: int, *, extra: int = 24, iterations: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Top-``rank`` eigenvectors [..., rank, D] (rows, largest eigenvalue first, float64) and eigenvalues
    [..., rank] of symmetric positive semi-definite ``moment`` [..., D, D], by ``iterations`` rounds of
    subspace iteration on ``rank + extra`` columns (at most 32 and D) and a Rayleigh-Ritz step. ``None``
    when some matrix's iteration broke down (rank below the subspace's width): callers use ``eigh``."""
    found = subspace_eigenvectors(moment, rank, extra=extra, iterations=iterations, seed=seed)
    if found is None or not bool(found[2].all()):
        return None
    return found[0], found[1]
