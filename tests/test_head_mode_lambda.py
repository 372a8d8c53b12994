"""The ``head-mode`` router finds its lambda among the crossings of the modes' objectives with one host read, where it
searched by bisection with a read a step: the same modes and lambda as the bisection, written out here, and the
smallest lambda that fits where several heads cross at once."""

from __future__ import annotations

import pytest
import torch

from kvweave.plugins.routers.head_mode import decide

from test_graphs_warm import _HostReads


def _bisection(loss, omega, cost, budget, steps=60):
    """The head-mode router's search before: bisection on lambda, a host read a step."""
    def modes_at(lam):
        return (loss + lam * omega).argmin(dim=-1)

    def spent(lam):
        return float(cost[modes_at(lam)].sum())

    if spent(0.0) <= budget:
        return modes_at(0.0), 0.0
    low, high = 0.0, 2.0 * float(loss.amax().clamp_min(0)) / float(omega[omega > 0].min()) + 1e-12
    for _ in range(steps):
        middle = (low + high) / 2
        low, high = (middle, high) if spent(middle) > budget else (low, middle)
    return modes_at(high), high


def _mode_table(seed, ties=False):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, modes = 1 + seed % 4, 2 + seed % 7, 3 + seed % 4
    cost = torch.cat((torch.zeros(1), torch.rand(modes - 1, generator=gen).sort().values * 1000)).double()
    loss = torch.rand(batch, heads, modes, generator=gen).double().sort(dim=-1, descending=True).values
    if ties:  # losses on a grid and costs in equal steps: several heads cross at the same lambda
        loss, cost = (loss * 4).round() / 4, torch.arange(modes).double() * 100
    full = float(cost[loss.argmin(-1)].sum())
    return loss, cost / 5000, cost, full * float(torch.rand(1, generator=gen))


def test_head_mode_lambda_found_among_the_crossings_is_the_bisections_with_one_host_read():
    for seed in range(60):
        loss, omega, cost, budget = _mode_table(seed)
        with _HostReads(twins=()) as reads:
            modes, lam = decide(loss, omega, cost, budget)
        assert sum(reads.sites.values()) <= 1, dict(reads.sites)
        reference, reference_lam = _bisection(loss, omega, cost, budget)
        assert torch.equal(modes, reference), seed
        assert lam == pytest.approx(reference_lam, rel=1e-9, abs=1e-12), seed
        assert float(cost[modes].sum()) <= budget


def test_head_mode_lambda_at_tied_crossings_is_still_the_smallest_that_fits():
    for seed in range(40):
        loss, omega, cost, budget = _mode_table(seed, ties=True)
        modes, lam = decide(loss, omega, cost, budget)
        assert float(cost[modes].sum()) <= budget, seed
        objective = loss + lam * omega  # every head's mode minimizes Eq. (2) at lambda (up to rounding)
        assert bool((objective.gather(-1, modes.unsqueeze(-1)).squeeze(-1) <= objective.amin(-1) + 1e-9).all()), seed
        if lam > 0:  # and just below lambda the modes do not fit
            assert float(cost[(loss + lam * (1 - 1e-9) * omega).argmin(-1)].sum()) > budget, seed
    loss, omega, cost, _ = _mode_table(3)
    modes, lam = decide(loss, omega, cost, None)
    assert torch.equal(modes, loss.argmin(-1)) and lam == 0.0
