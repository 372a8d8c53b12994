"""The ``pairs`` form of the ``tiles`` pass (kernels/depthweave_pairs_triton.py, ``TILES_PAIRS``): two tokens a tile
row where a KV head has four query heads, the heads twice as the 8 columns. Against the float32 twin and the ``tiles``
pass over storage written by the real engine, when the launcher takes it, its build for a GPU, and on a GPU. Under
``TRITON_INTERPRET=1`` on a machine without CUDA (conftest.py)."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels import depthweave_decode
from kvweave.kernels.decode_torch import torch_decode, torch_packed_logsumexp
from kvweave.kernels.depthweave_decode import fused_decode, fused_packed_logsumexp
from kvweave.kernels.gpu_build import launch_job

from conftest import write_registry
from test_kernels import DEVICE, decode_view, llama_config
from test_lowbit_kernel_host import _nvidia_backend, compile_job
from test_tiles_pass import TILES_REGISTRY


def _case(tmp_path, name, tokens=320):
    """A layer of ``name`` filled with ``tokens`` tokens of two rows at four query heads a KV head (8 query heads, 2
    KV heads, head_dim 128), a query and rows' first positions (the second row's 70)."""
    pipeline = load_pipeline(name, write_registry(tmp_path, "pairs", TILES_REGISTRY))
    cache = fill_cache(KVWeaveCache(pipeline, llama_config(8, 2, 128)), 2, tokens, chunk=107, dtype=torch.bfloat16,
                       device=DEVICE, seed=3)
    torch.manual_seed(1)
    return decode_view(cache, 1), torch.randn(2, 8, 128, device=DEVICE), torch.tensor([0, 70], dtype=torch.int32,
                                                                                        device=DEVICE)


def _both(monkeypatch, view, query, start, **kwargs):
    """The ``tiles`` pass's output, then its pairs form's, over the same call."""
    outputs = []
    for pairs in (False, True):
        monkeypatch.setattr(depthweave_decode, "TILES_PAIRS", pairs)
        outputs.append(fused_decode(view, query, start, 128**-0.5, variant="tiles", **kwargs))
    return outputs


@pytest.mark.parametrize("name, split", [("dw-kernel", 96), ("dw-kernel", None), ("dw-kernel-blocks", 96),
                                         ("dw-kernel-bases", 96), ("dw-kernel-wide", 96)])
def test_two_tokens_a_row_give_the_sums_of_one(tmp_path, monkeypatch, name, split):
    """The pairs form against the ``tiles`` pass and the twin, for three routed levels, two int8 scales a token, no
    residuals, and rank-16 entries (64-bit words: each token's 16 coordinates in its half of a 32-column tile), over
    segments of 96 tokens (a last step of 32, whose odd half and next step lie past the segment) or the cache's own,
    and a row whose first position falls inside a pair (70). The two passes add in other
    orders, so they agree to float rounding, not to the bit; with routed residuals the twin without them is far off."""
    view, query, start = _case(tmp_path, name)
    if name == "dw-kernel-wide":
        assert any(level.rank == 16 and level.entries for level in view.k_levels + view.v_levels)
    tiles, pairs = _both(monkeypatch, view, query, start, split=split)
    twin = torch_decode(view, query, start, 128**-0.5)
    assert (pairs - twin).abs().max().item() < 1e-3
    assert (pairs - tiles).abs().max().item() < 1e-3
    assert not torch.equal(pairs, tiles) or name == "dw-kernel-bases"  # the pairs form ran, not the tiles pass again


@pytest.mark.parametrize("ahead", [False, True])
def test_the_pairs_form_reads_its_words_ahead_or_not_to_the_same_sums(tmp_path, monkeypatch, ahead):
    """``TILES_AHEAD`` off or on (the words loaded in the step or the step before), over 200 tokens: a segment's last
    pair cut in two by its end."""
    view, query, start = _case(tmp_path, "dw-kernel", tokens=200)
    monkeypatch.setattr(depthweave_decode, "TILES_AHEAD", ahead)
    tiles, pairs = _both(monkeypatch, view, query, start, split=96)
    assert (pairs - torch_decode(view, query, start, 128**-0.5)).abs().max().item() < 1e-3
    assert (pairs - tiles).abs().max().item() < 1e-3


def test_the_pairs_form_gives_the_flush_statistics(tmp_path, monkeypatch):
    """Without values (:func:`fused_packed_logsumexp`, four query rows a KV head): the log-sum-exp of the twin."""
    view, query, _ = _case(tmp_path, "dw-kernel")
    monkeypatch.setattr(depthweave_decode, "TILES_PAIRS", True)
    got = fused_packed_logsumexp(view, query, 128**-0.5, variant="tiles")
    assert got.shape == (2, 8) and torch.isfinite(got).all()
    assert (got - torch_packed_logsumexp(view, query, 128**-0.5)).abs().max().item() < 1e-3


def _launched(monkeypatch, view, query, block=None) -> list[str]:
    """Which kernels ``fused_decode`` launches for the packed tokens of ``view`` (recorded, not run)."""
    from kvweave.kernels import depthweave_pairs_triton, depthweave_tiles_triton

    names: list[str] = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **constants: names.append(self.name)

    monkeypatch.setattr(depthweave_pairs_triton, "_pairs_kernel", Recorder("pairs"))
    monkeypatch.setattr(depthweave_tiles_triton, "_tiles_kernel", Recorder("tiles"))
    try:
        fused_decode(view, query, None, 0.125, block_tokens=block, variant="tiles")
    except Exception:  # the combine reads the recorded pass's outputs, which were never written
        pass
    return names


def test_the_pairs_form_is_launched_for_four_query_heads_a_kv_head_only(tmp_path, monkeypatch):
    view, query, _ = _case(tmp_path, "dw-kernel")
    monkeypatch.setattr(depthweave_decode, "TILES_PAIRS", False)
    assert _launched(monkeypatch, view, query) == ["tiles"]
    monkeypatch.setattr(depthweave_decode, "TILES_PAIRS", True)
    assert _launched(monkeypatch, view, query) == ["pairs"]
    assert _launched(monkeypatch, view, query, block=32) == ["tiles"]  # 32-token steps: the tiles pass
    assert not depthweave_decode.pairs_apply(8, 64) and not depthweave_decode.pairs_apply(2, 64)
    monkeypatch.setattr(depthweave_decode, "TILES_WORDS", 2)  # the word loads are the tiles pass's own
    assert _launched(monkeypatch, view, query) == ["tiles"]


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
def test_the_pairs_form_builds_for_a_gpu(tmp_path, monkeypatch):
    """Built for sm_90 with the arguments the launcher passes on a GPU: population counts and byte permutes."""
    from kvweave.kernels import depthweave_pairs_triton as pairs_jit

    view, query, _ = _case(tmp_path, "dw-kernel")
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((args, constants))

    monkeypatch.setattr(depthweave_decode, "TILES_PAIRS", True)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pairs_jit, "_pairs_kernel", Recorder())
        try:
            fused_decode(view, query, None, 0.125, variant="tiles")
        except Exception:  # the combine reads the recorded pass's outputs
            pass
    args, constants = launches[0]
    job = launch_job(pairs_jit._pairs_kernel, args, constants)
    job["constants"].update(ASM=True, BYTES=True)
    built = compile_job(job)
    assert built["cubin"] > 0 and "popc" in built["ptx_text"] and "0x64646464" in built["ptx_text"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["dw-kernel", "dw-kernel-blocks", "dw-kernel-wide"])
def test_two_tokens_a_row_on_the_gpu(tmp_path, monkeypatch, name):
    """Compiled, with the byte permutes: the pairs form against the ``tiles`` pass and the twin."""
    view, query, start = _case(tmp_path, name)
    tiles, pairs = _both(monkeypatch, view, query, start, split=96)
    assert (pairs.float() - tiles.float()).abs().max().item() < 1e-3
    assert (pairs.float() - torch_decode(view, query, start, 128**-0.5).float()).abs().max().item() < 2e-2
