"""A residual basis fitted without a host read of its own: :func:`kvweave.core.linalg.subspace_eigenvectors` leaves
whether the iteration worked on the device, :class:`kvweave.engine.residuals.ResidualFit` reads it only when its basis
is asked for, and the encoder queues the fit before the ranks' host read and asks after it. On a GPU a prompt's flush
then waits for the forward's queued work once a kind, with the fit's launches already queued behind it."""

from __future__ import annotations

import traceback

import pytest
import torch

import kvweave.engine.encoder as encoder_module
from kvweave.core.linalg import rayleigh_ritz, subspace_eigenvectors, subspace_iteration, top_eigenvectors
from kvweave.engine.residuals import ResidualFit, begin_residual_fit, fit_residual_basis

from test_graphs_warm import HOST_READS


class _ReadOrder(torch.overrides.TorchFunctionMode):
    """The engine's host reads in the order made: (read, function that made it); ``all`` and ``any`` count only
    when their result is read (``__bool__``)."""

    def __init__(self):
        super().__init__()
        self.reads: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS - {"all", "any"}:  # reductions stay on the device until read
            frames = [f for f in traceback.extract_stack(limit=12)[:-1] if "/engine/" in f.filename or "/core/" in f.filename]
            self.reads.append((name, frames[-1].name if frames else "?"))
        return func(*args, **(kwargs or {}))


def _moments(deficient: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(3, 2000, 128, generator=gen) * torch.linspace(3.0, 0.1, 128)
    if deficient:
        x[1] = 0
        x[1, :, :10] = torch.randn(2000, 10, generator=gen)  # rank 10, below the 32 columns iterated
    return x.transpose(-1, -2) @ x


def test_the_subspace_iteration_reads_nothing_and_flags_each_matrix():
    moment = _moments(deficient=True)
    with _ReadOrder() as order:
        q, ok = subspace_iteration(moment, 8)
    assert order.reads == []
    assert ok.tolist() == [True, False, True]
    vectors, values = rayleigh_ritz(moment, q, 8)  # its Rayleigh-Ritz step, apart: the GPU's eigh reads on the host
    for mine, joined in zip((vectors, values, ok), subspace_eigenvectors(moment, 8)):  # the broken matrix's NaNs too
        torch.testing.assert_close(mine, joined, rtol=0, atol=0, equal_nan=True)
    assert top_eigenvectors(moment, 8) is None  # the reading form gives up on the batch
    good = _moments()
    found = top_eigenvectors(good, 8)
    assert torch.equal(found[0], subspace_eigenvectors(good, 8)[0])


@pytest.mark.parametrize("deficient", [False, True])
def test_a_fits_basis_is_the_iterations_where_it_worked_else_eigh(deficient):
    moment = _moments(deficient)
    fit = ResidualFit(moment, 8, subspace_iteration(moment, 8))  # the GPU's path, taken here on the CPU
    basis = fit.basis()
    _, vectors = torch.linalg.eigh(moment)
    eigh = vectors.flip(-1)[..., :8].transpose(-1, -2).to(torch.float16)
    assert basis.dtype == torch.float16 and basis.shape == (3, 8, 128)
    if deficient:
        assert torch.equal(basis, eigh)
    else:
        assert torch.equal(basis, subspace_eigenvectors(moment, 8)[0].to(torch.float16))
        overlap = (basis[0].float() @ eigh[0].float().T).abs().amax(-1)  # the same directions as eigh's
        assert bool((overlap > 0.99).all()), overlap


def test_begin_then_basis_is_the_one_call_fit():
    missing = torch.randn(2, 3, 500, 64, generator=torch.Generator().manual_seed(2))
    assert torch.equal(begin_residual_fit(missing, 8).basis(), fit_residual_basis(missing, 8))
    with pytest.raises(ValueError, match="at least one leading dimension"):
        begin_residual_fit(torch.randn(5, 64), 8)


def test_a_flush_queues_the_fit_before_the_ranks_host_read_and_reads_its_flag_after(monkeypatch):
    from conftest import tiny_llama
    from helpers import build_test_cache, prefill, random_ids

    order = _ReadOrder()
    events: list[str] = []

    def mark(event: str) -> None:
        events.append(event)
        order.reads.append(("mark", event))

    def begin(rows, rank):  # the GPU's fit (subspace iteration), taken on the CPU
        mark("begin")
        fit = begin_residual_fit(rows, rank)
        return ResidualFit(fit.moment, rank, subspace_iteration(fit.moment, rank))

    basis, rank_counts = ResidualFit.basis, encoder_module.BlockEncoder.rank_counts
    monkeypatch.setattr(encoder_module, "begin_residual_fit", begin)
    monkeypatch.setattr(ResidualFit, "basis", lambda self: mark("basis") or basis(self))
    monkeypatch.setattr(encoder_module.BlockEncoder, "rank_counts", lambda self, *a: mark("counts") or rank_counts(self, *a))
    model = tiny_llama(torch.float32, layers=4, hidden=512)
    cache = build_test_cache("depthweave-kv", model)
    with order:
        prefill(model, cache, random_ids(1, 400, seed=4))
    assert events[:6] == ["begin", "counts", "basis"] * 2  # keys, then values, of the first group
    fitted = [cache.engine.windows[layer].residual_basis[kind] for layer in range(4) for kind in ("keys", "values")]
    assert all(b is not None and b.dtype == torch.float16 for b in fitted)
    reads = order.reads[: order.reads.index(("mark", "basis"), order.reads.index(("mark", "basis")) + 1) + 2]
    for kind in range(2):  # from the fit's start: the ranks' counts are the first read, the fit's flag the next
        start = reads.index(("mark", "begin"))
        assert reads[start + 1:start + 5] == [("mark", "counts"), ("tolist", "rank_counts"), ("mark", "basis"), ("__bool__", "basis")], (kind, reads[start:])
        reads = reads[start + 5:]
