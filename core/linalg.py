"""Small batched linear algebra that stays fast on a GPU: what the prompt's compression needs.

On CUDA, ``torch.linalg.qr`` of tall matrices, ``eigh`` of matrices above 32 x 32 and ``svd`` run one
cuSOLVER call per matrix of the batch (8 heads x 4 layers x 2 kinds per window: milliseconds each), while
Cholesky factorizations, triangular solves and ``eigh`` of matrices up to 32 x 32 run batched. The
functions here are built from those:

- :func:`cholesky_qr`: orthonormal columns of a tall ``A`` (CholeskyQR2, float64 Gram matrices), with a
  flag per matrix saying whether it worked (a rank-deficient ``A`` fails: callers fall back);
- :func:`top_eigenvectors`: the top eigenvectors of symmetric PSD matrices by subspace iteration with a
  Rayleigh-Ritz step on a <= 32 x 32 matrix; :func:`subspace_eigenvectors` the same without reading whether it
  worked (no host read: the caller reads the flag where it reads the host anyway), in two parts:
  :func:`subspace_iteration` (nothing read by the host) and :func:`rayleigh_ritz` (its small ``eigh`` is: torch
  reads its convergence there);
- :func:`seeded_gaussian`: a seeded Gaussian matrix, on a GPU made once and sent without a wait;
- :func:`tall_product`: ``A^T B`` summed over a long token axis (a block's second moment, a sketch's projections, a
  probe's weighted values). cuBLAS runs a batch of such products one tile of the small output per program, so 8 heads'
  128 x 128 second moments over 32K tokens keep 8 of an H100's 132 SMs busy; cut into chunks of the token axis, each
  chunk a matrix of the batch, and summed after, they fill the GPU; :func:`tall_gram`: ``A^T A`` in float32, a 16-bit
  ``A`` on a GPU multiplied as it is; :func:`float32_product`: ``A B`` in float32, 16-bit operands on a GPU as they are.
"""

from __future__ import annotations

import functools

from kvweave.core.environment import env_setting
from kvweave.core.host_to_device import send
from kvweave.core.lazy import torch

#: tokens a chunk of :func:`tall_product` on a CUDA GPU (0: one product over the whole axis, as before); the
#: environment's KVWEAVE_TALL_CHUNK sets it, to time the two ways in one run
TALL_CHUNK = env_setting("KVWEAVE_TALL_CHUNK", 1024, (0, 256, 512, 1024, 2048, 4096, 8192))


def seeded_gaussian(
    shape: tuple[int, ...], seed: int, device: torch.device, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """A standard Gaussian matrix from a CPU generator seeded with ``seed`` (the same numbers on every device), on
    ``device``, float32 unless ``dtype`` says; read-only, as it is shared. On a GPU it is made once (the last 64 kept:
    a basis takes a new seed with each version) and sent from pinned memory without waiting: a tensor sent from
    ordinary host memory waits for every kernel queued before it, and a prompt's flush would then wait for the model's
    queued layers before it queued its own first product."""
    dtype = torch.float32 if dtype is None else dtype  # (a default of torch.float32 would import torch with the module)
    if torch.device(device).type != "cuda":
        return _gaussian_on_host(tuple(shape), seed, dtype).to(device)
    return _gaussian_on_gpu(tuple(shape), seed, dtype, str(device))


def _gaussian_on_host(shape: tuple[int, ...], seed: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(shape, generator=generator, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _gaussian_on_gpu(shape: tuple[int, ...], seed: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    return send(_gaussian_on_host(shape, seed, dtype), device)


def tall_chunk(device: torch.device, tokens: int) -> int:
    """The chunk :func:`tall_product` cuts ``tokens`` into on ``device``: :data:`TALL_CHUNK` on a CUDA GPU where that
    makes two chunks or more, else 0 (one product: a CPU's BLAS splits the long axis itself)."""
    if device.type != "cuda" or not TALL_CHUNK or tokens < 2 * TALL_CHUNK:
        return 0
    return TALL_CHUNK


def _chunks(tokens: int, chunk: int) -> tuple[int, int]:
    """``(parts, length)`` of :func:`tall_product`'s chunks: a count that divides ``tokens`` into chunks of ``chunk`` to
    ``2 chunk`` tokens where there is one (a contiguous input is then a view of whole chunks, no copy), else whole
    chunks of ``chunk`` tokens and a rest."""
    for parts in range(tokens // chunk, tokens // (2 * chunk), -1):
        if tokens % parts == 0:
            return parts, tokens // parts
    return tokens // chunk, chunk


def tall_product(a: torch.Tensor, b: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """``a^T b`` [..., p, q] for ``a`` [..., n, p] and ``b`` [..., n, q] (leading dimensions broadcast), summed over the
    token axis ``n`` in chunks of about ``chunk`` tokens (None: :func:`tall_chunk`'s; 0: one product): the chunks as one
    batched product whose partial results are summed in the inputs' dtype, a rest of the axis (where no count of chunks
    of ``chunk`` to ``2 chunk`` tokens divides it) as one product more. A transposed ``a`` (``w.transpose(-1, -2)``
    for ``w @ b``) is read where it lies if torch can, else copied once. Two 16-bit operands of one dtype and leading
    shape on a CUDA GPU are multiplied as they are, into float32 (:func:`float32_product`)."""
    if a.shape[-2] != b.shape[-2]:
        raise ValueError(f"tall_product: the token axes differ, {tuple(a.shape)} against {tuple(b.shape)}")
    tokens = a.shape[-2]
    if chunk is None:
        chunk = tall_chunk(a.device, tokens)
    if chunk < 0:
        raise ValueError(f"tall_product: chunk must be >= 0, got {chunk}")
    times = float32_product if _sixteen_on_gpu(a, b) else torch.matmul
    if not chunk or tokens < 2 * chunk:
        return times(a.transpose(-1, -2), b)
    parts, length = _chunks(tokens, chunk)
    whole = parts * length
    a_chunks = a[..., :whole, :].unflatten(-2, (parts, length))  # [..., S, c, p]
    b_chunks = b[..., :whole, :].unflatten(-2, (parts, length))
    out = times(a_chunks.transpose(-1, -2), b_chunks).sum(dim=-3)
    if whole < tokens:
        out = out + times(a[..., whole:, :].transpose(-1, -2), b[..., whole:, :])
    return out


def tall_gram(a: torch.Tensor) -> torch.Tensor:
    """``a^T a`` [..., p, p] (float32) for ``a`` [..., n, p]: :func:`tall_product` of ``a`` with itself, a 16-bit ``a`` on
    a CUDA GPU multiplied as it is (each product of two 16-bit numbers exact in float32, summed in float32), without a
    float32 copy's bytes and on tensor cores. The chunks matter here too: the tensor cores' float32 sums drift with the
    length summed (5.7e-5 of the largest entry over 16K tokens on an H100, against 1.6e-6 for the float32 copy's
    product in chunks)."""
    if not _sixteen_on_gpu(a, a):
        a = a.float()
    return tall_product(a, a)


def _sixteen_on_gpu(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a @ b`` can run on their 16-bit values into float32 (:func:`float32_product`'s first way)."""
    return a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.float16, torch.bfloat16) and a.shape[:-2] == b.shape[:-2]


def float32_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` [..., m, n] in float32 for ``a`` [..., m, k] and ``b`` [..., k, n] of the same leading shape: two
    16-bit operands of one dtype on a CUDA GPU multiplied as they are (``bmm``'s ``out_dtype``: products exact in
    float32, summed in float32, no float32 copies), else the product of their float32 values."""
    if _sixteen_on_gpu(a, b):
        out = torch.bmm(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]), out_dtype=torch.float32)
        return out.view(*a.shape[:-2], a.shape[-2], b.shape[-1])
    return a.float() @ b.float()


def cholesky_qr(a: torch.Tensor, rounds: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q, ok)``: ``Q`` [..., m, k] (float64) with orthonormal columns spanning those of ``a`` [..., m, k]
    (``m >= k``), by ``rounds`` rounds of ``Q = A R^-1`` with ``R^T R = A^T A``; ``ok`` [...] is false where a
    Cholesky factorization failed or the result is not finite (then ``Q`` is meaningless there). One round spans the
    same columns, orthonormal to about ``eps cond(A)^2`` only: enough inside an iteration whose next step only needs
    the span (the steps of a subspace iteration), two (CholeskyQR2) where the columns themselves are used."""
    q = a.double()
    ok = torch.ones(a.shape[:-2], dtype=torch.bool, device=a.device)
    for _ in range(rounds):
        gram = tall_product(q, q)
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
    width. :func:`subspace_iteration`, then :func:`rayleigh_ritz` (whose small ``eigh`` makes the host wait for the
    GPU: torch reads its convergence on the host)."""
    found = subspace_iteration(moment, rank, extra=extra, iterations=iterations, seed=seed)
    if found is None:
        return None
    q, ok = found
    vectors, values = rayleigh_ritz(moment, q, rank)
    return vectors, values, ok


def subspace_iteration(
    moment: torch.Tensor, rank: int, *, extra: int = 24, iterations: int = 10, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The orthonormal columns ``q`` [..., D, width] (float64) of ``iterations`` rounds of subspace iteration on
    ``moment`` [..., D, D] from a seeded start, and ``ok`` [...] (false where it broke down); ``None`` where ``rank``
    exceeds the width (``rank + extra``, at most 32 and D). Nothing read by the host. The span after the steps is
    ``moment^(iterations + 1)`` times the start whatever the steps orthonormalize in between, so it steps by
    ``moment^2`` and orthonormalizes each step by one Cholesky round, the last twice: 7 rounds for 10 iterations where a
    round of two a power took 22 (each round a few small kernels, and the prompt's flush bound by the host issuing
    them)."""
    dim = moment.shape[-1]
    width = min(rank + extra, 32, dim)
    if width < rank:
        return None
    m = moment.double()
    q = seeded_gaussian((dim, width), seed, m.device, torch.float64)
    q, ok = cholesky_qr(m @ q, rounds=1)
    square = m @ m
    for _ in range(iterations // 2):
        q, step_ok = cholesky_qr(square @ q, rounds=1)
        ok &= step_ok
    if iterations % 2:
        q, step_ok = cholesky_qr(m @ q, rounds=1)
        ok &= step_ok
    q, step_ok = cholesky_qr(q, rounds=1)  # the last step's second round: orthonormal columns for Rayleigh-Ritz
    return q, ok & step_ok


def rayleigh_ritz(moment: torch.Tensor, q: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-``rank`` eigenvectors [..., rank, D] (rows, float64, largest first) and eigenvalues of ``moment``
    [..., D, D] within the span of the orthonormal columns ``q`` [..., D, width]."""
    m = moment.double()
    small = q.transpose(-1, -2) @ m @ q  # [..., width, width]
    values, vectors = torch.linalg.eigh((small + small.transpose(-1, -2)) / 2)  # ascending
    top = vectors.flip(-1)[..., :rank]  # [..., width, rank], largest first
    return (q @ top).transpose(-1, -2), values.flip(-1)[..., :rank]


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
