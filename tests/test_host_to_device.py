"""Small host tensors sent to the device without a wait (core/host_to_device.py), the seeded Gaussian matrices
(core/linalg.py ``seeded_gaussian``) and the router's budget shift after its constants moved there."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.host_to_device import device_constant, on_device, send
from kvweave.core.linalg import seeded_gaussian
from kvweave.plugins.routers.sigmoid_multilevel import budget_shift


def test_device_constant_holds_the_numbers_once_per_dtype():
    first = device_constant([0, 2, 4, 8], torch.int64, "cpu")
    assert first.dtype == torch.int64 and first.tolist() == [0, 2, 4, 8]
    assert device_constant((0, 2, 4, 8), torch.int64, torch.device("cpu")) is first  # made once
    wider = device_constant((0, 2, 4, 8), torch.float64, "cpu")
    assert wider is not first and wider.dtype == torch.float64


def test_send_keeps_values_and_dtype():
    host = torch.arange(6, dtype=torch.int16).view(2, 3)
    sent = send(host, "cpu")
    assert torch.equal(sent, host) and sent.dtype == torch.int16


def test_seeded_gaussian_is_the_generators_numbers():
    generator = torch.Generator(device="cpu").manual_seed(11)
    expected = torch.randn(5, 3, generator=generator, dtype=torch.float64)
    assert torch.equal(seeded_gaussian((5, 3), 11, torch.device("cpu"), torch.float64), expected)
    assert not torch.equal(seeded_gaussian((5, 3), 12, torch.device("cpu"), torch.float64), expected)


@pytest.mark.parametrize("budget", [0.0, 3.0, 7.5, 40.0, 1e9])
def test_budget_shift_spends_at_most_the_budget_and_no_less_than_one_crossing_more_would(budget):
    """The shift lets the levels ``(over > shift).sum(-1)`` cost at most ``budget``; one crossing further would pass
    it, unless every crossing fits (then the shift is -inf)."""
    torch.manual_seed(0)
    scores = torch.rand(2, 3, 50)  # as the router makes them: each token's score less each level's threshold
    over = scores.unsqueeze(-1) - torch.tensor([0.25, 0.5, 0.75])
    cost = [0.0, 1.0, 2.5, 4.0]
    shift = budget_shift(over, cost, budget)
    assert shift.dim() == 0 and shift.dtype == over.dtype

    def spent(delta):
        levels = (over > delta).sum(-1)
        return torch.tensor(cost)[levels].sum().item()

    assert spent(shift) <= budget + 1e-9
    if torch.isinf(shift):
        assert spent(float("-inf")) <= budget
    else:
        assert spent(shift - 1e-6) > budget  # the next crossing down would pass the budget


#: where a flush of depthweave-kv's prompt may make the host wait for the GPU (the innermost kvweave function, with its
#: caller where that says more): the sketch's flag and its small eigendecomposition (torch reads eigh's convergence on
#: the host; the basis is needed before anything else of the block), the rank counts' read, the residual fit's flag and
#: its Rayleigh-Ritz step after it, the probe's shares after the block is stored, the deferred checks
FLUSH_WAITS = {"gram_top_right", "gram_top_right/rayleigh_ritz", "rank_counts", "basis", "basis/rayleigh_ritz", "adjust",
               "resolve"}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="counts the host's waits for a CUDA GPU")
def test_depthweave_kv_prompt_flush_waits_for_the_gpu_only_where_it_must():
    """Within the flushes of depthweave-kv's prompt, every call that makes the host wait for the GPU
    (``torch.cuda.set_sync_debug_mode``) is one of :data:`FLUSH_WAITS`: nothing sent from ordinary host memory, no
    0-d index, no fit's eigendecomposition before the routing."""
    import os
    import traceback
    import warnings

    import kvweave.core
    from kvweave.engine import build_cache, cache_kwargs
    from test_graphs import _Vocabulary
    from test_graphs_gpu import _gpu_llama

    root = os.path.dirname(os.path.dirname(os.path.abspath(kvweave.core.__file__)))
    net, ids = _gpu_llama(128, 4)

    def prompt(cache):
        with torch.no_grad():
            net.generate(input_ids=ids, max_new_tokens=1, do_sample=False, **cache_kwargs(net, cache))

    prompt(build_cache("depthweave-kv", net, tokenizer=_Vocabulary()))  # what is made once a device, made
    torch.cuda.synchronize()
    stacks: list[list[tuple[str, str]]] = []
    cache = build_cache("depthweave-kv", net, tokenizer=_Vocabulary())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = lambda message, *args, **kwargs: "synchroniz" in str(message) and stacks.append(
            [(f.filename, f.name) for f in traceback.extract_stack()])  # torch's, not e.g. the budget's warning
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prompt(cache)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    in_flushes = [stack for stack in stacks if any(name == "_flush" for _, name in stack)]
    assert in_flushes, "the prompt was not flushed, or its flushes never waited for the GPU"
    tests = os.path.join(root, "tests") + os.sep  # this test's own frames (the warning's hook) are not kvweave's
    ours = [[name for path, name in stack if os.path.abspath(path).startswith(root + os.sep)
             and not os.path.abspath(path).startswith(tests)] for stack in in_flushes]
    innermost = [names[-1] if names[-1] != "rayleigh_ritz" else f"{names[-2]}/rayleigh_ritz" for names in ours]
    assert set(innermost) <= FLUSH_WAITS, innermost
    assert "rank_counts" in innermost


def test_on_device_makes_a_hosts_constants_once_and_leaves_the_rest():
    gates = torch.tensor([0.25, 0.75])
    assert on_device(None, "meta") is None
    assert on_device(gates, "cpu") is gates  # a host tensor for the host
    sent = on_device(gates, "meta")  # a device without data stands in for a GPU here
    assert sent.device.type == "meta" and sent.shape == (2,) and sent.dtype == torch.float32
    assert on_device(torch.tensor([0.25, 0.75]), "meta") is sent  # the same numbers: the tensor made before
    assert on_device(sent, "cpu") is sent  # already on a device: as it is


@pytest.mark.skipif(not torch.cuda.is_available(), reason="decodes with a trained router on a CUDA GPU")
def test_a_trained_routers_gates_reach_the_gpu(tmp_path):
    """A depthweave-kv pipeline with a weights file (residual gates per layer and head, made on the host) stores and
    decodes on the GPU: the gates reach the flush's reconstruction and the fused kernel on the cache's device."""
    import json

    from kvweave.core.registry import load_registry
    from kvweave.engine import build_cache, cache_kwargs
    from kvweave.plugins.routers.sigmoid_multilevel import FEATURES
    from test_graphs import _Vocabulary
    from test_graphs_gpu import _gpu_llama

    net, ids = _gpu_llama(128, 4)
    weights = tmp_path / "weights.json"
    rows = [[0.5, 0.9]] * 4  # 4 layers x 2 KV heads
    weights.write_text(json.dumps({"features": list(FEATURES), "u": [1.0, 1.0, 0.5, 0.5, 2.0], "bias": -1.0,
                                   "gates": {"keys": rows, "values": rows}}))
    registry = tmp_path / "registry.toml"
    registry.write_text(f'[pipelines.gated]\nextends = "depthweave-kv"\n\n[pipelines.gated.router]\nweights = "{weights}"\n')
    cache = build_cache(load_registry(registry).resolve("gated"), net, tokenizer=_Vocabulary())
    with torch.no_grad():
        out = net.generate(input_ids=ids, max_new_tokens=40, do_sample=False, **cache_kwargs(net, cache))
    assert out.shape == (2, 340) and cache.engine.windows[0].compressed_tokens > 0
