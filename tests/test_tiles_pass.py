"""The ``tiles`` packed-token pass of the fused decode kernel (kernels/depthweave_tiles_triton.py): against the float32
twin and the ``gather`` pass over storage written by the real engine, its switches, what it refuses, its build for a
GPU, the kept window of a CUDA graph, and the flush's attention statistics. Under ``TRITON_INTERPRET=1`` on a machine
without CUDA (conftest.py), compiled on the GPU machine."""

from __future__ import annotations

import textwrap

import attrs
import pytest
import torch

from kvweave.core.registry import load_pipeline
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels import depthweave_decode
from kvweave.kernels.decode_torch import torch_decode, torch_packed_logsumexp
from kvweave.kernels.depthweave_decode import fused_decode, fused_packed_logsumexp, pick_variant, tiles_refusal
from kvweave.kernels.gpu_build import launch_job

from conftest import write_registry
from test_kernels import DEVICE, REGISTRY, decode_view, filled, llama_config
from test_lowbit_kernel_host import _nvidia_backend, compile_job


TILES_REGISTRY = REGISTRY + textwrap.dedent(
    """
    [pipelines.dw-kernel-blocks]
    extends = "dw-kernel"
    [pipelines.dw-kernel-blocks.quantizer]
    block = 8
    [pipelines.dw-kernel-bases]
    extends = "dw-kernel"
    [pipelines.dw-kernel-bases.router]
    use = "uniform"
    rank = 0
    [pipelines.dw-kernel-wide]
    extends = "dw-kernel"
    [pipelines.dw-kernel-wide.router]
    levels = [0, 4, 16]
    target_reduction = 1.2
    [pipelines.dw-kernel-wide.residual_quantizer]
    group = 4
    """
)


#: the decode views :func:`_tiles_case` filled, by pipeline and KV heads: each is filled once a session (the tests that
#: take one only read it; a kernel call and ``attrs.evolve`` leave it as it is)
_TILES_VIEWS: dict[tuple[str, int] | str, object] = {}


def _tiles_case(tmp_path, name, kv_heads: int = 2):
    """A layer of ``name`` (TILES_REGISTRY) filled with 320 tokens of two rows, a query and rows' first positions
    (``dw-kernel``: 8 query heads over ``kv_heads`` at head_dim 128; ``dw-kernel-wide``: 16 over one at 64)."""
    q_heads, kv_heads, dim = (16, 1, 64) if name == "dw-kernel-wide" else (8, kv_heads, 128)
    if (name, kv_heads) not in _TILES_VIEWS:
        pipeline = load_pipeline(name, write_registry(tmp_path, "tiles", TILES_REGISTRY))
        cache = fill_cache(KVWeaveCache(pipeline, llama_config(q_heads, kv_heads, dim)), 2, 320, chunk=107,
                           dtype=torch.bfloat16, device=DEVICE, seed=3)
        _TILES_VIEWS[name, kv_heads] = decode_view(cache, 1)
    torch.manual_seed(1)
    query = torch.randn(2, q_heads, dim, device=DEVICE)
    return _TILES_VIEWS[name, kv_heads], query, torch.tensor([0, 70], dtype=torch.int32, device=DEVICE), dim


#: per pipeline of :func:`_tiles_case` (the same view and query): the twin's output and the gather pass's
_GATHERED: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}


@pytest.mark.parametrize("name", ["dw-kernel", "dw-kernel-blocks", "dw-kernel-bases", "dw-kernel-wide"])
@pytest.mark.parametrize("block", [32, 64])
def test_the_tiles_pass_reads_what_the_gather_pass_reads(tmp_path, name, block):
    """The token-major ``tiles`` pass (residual entries read as one code word and one scale word a token) against the
    float32 twin, for three routed levels, two int8 scales a token, no residuals, and rank-16 entries (16 nibbles and
    four scales: 64-bit words) under 16 query heads a KV head at head_dim 64; with routed residuals, the twin without
    them is far off, so the pass reads them."""
    view, query, start, dim = _tiles_case(tmp_path, name)
    entries = sum(level.entries for level in view.k_levels + view.v_levels)
    assert (view.block < view.k_codes.shape[-1]) == (name == "dw-kernel-blocks")
    assert (entries > 0) == (name != "dw-kernel-bases")
    if name == "dw-kernel-wide":
        assert any(level.rank == 16 and level.entries for level in view.k_levels + view.v_levels)
    if name not in _GATHERED:  # the twin and the gather pass take no step size: each read once for both
        _GATHERED[name] = (torch_decode(view, query, start, dim**-0.5),
                           fused_decode(view, query, start, dim**-0.5, split=96, variant="gather"))
    twin, gather = _GATHERED[name]
    tiles = fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block, variant="tiles")
    assert (tiles - twin).abs().max().item() < 1e-3 and (gather - twin).abs().max().item() < 1e-3
    if entries:
        bare = attrs.evolve(view, k_levels=(), v_levels=(), k_residual_basis=None, v_residual_basis=None)
        assert (torch_decode(bare, query, start, dim**-0.5) - twin).abs().max().item() > 1e-2


#: the ``tiles`` pass's switches, each combination checked (columns, ahead, index, late)
SWITCHES = [(True, False, False, False), (False, True, False, False), (True, True, False, False),
            (True, True, True, False), (False, True, True, False), (True, True, False, True)]


@pytest.mark.parametrize("name, blocks", [("dw-kernel", (64, 32)), ("dw-kernel-wide", (64,))])
def test_the_tiles_pass_reads_its_residual_words_as_columns_or_a_step_ahead_to_the_same_sums(tmp_path, monkeypatch, name,
                                                                                         blocks):
    """The ``tiles`` pass's switches (``TILES_COLUMNS``: the words read as a column in the residual tile's layout;
    ``TILES_AHEAD``: each step's words loaded during the step before; both on by default since timed on the H200;
    ``TILES_INDEX``: the tile index read two steps ahead, its entries one; ``TILES_QUERY_LATE``: the query's products
    after the first step's loads) change where and when the words are read, not the sums: for each combination of
    :data:`SWITCHES`, the same output as the pass without them and as the twin, over segments of 96 tokens (a last
    step of 32 tokens, whose next steps lie past the segment), rows with a first position, 32- and 64-token steps and
    64-bit words. One KV head of two rows (each program one row's segment; the rows of the other tests' two heads
    are programs alike), one layer built for both step sizes."""
    view, query, start, dim = _tiles_case(tmp_path, name, kv_heads=1)
    assert any(level.entries for level in view.k_levels + view.v_levels)  # residual words to read
    twin = torch_decode(view, query, start, dim**-0.5)
    for block in blocks:
        run = lambda: fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block,  # noqa: E731
                                   variant="tiles")
        monkeypatch.setattr(depthweave_decode, "TILES_COLUMNS", False)
        monkeypatch.setattr(depthweave_decode, "TILES_AHEAD", False)
        monkeypatch.setattr(depthweave_decode, "TILES_INDEX", False)
        monkeypatch.setattr(depthweave_decode, "TILES_QUERY_LATE", False)  # on by default: the plain pass has it off
        plain = run()
        for columns, ahead, index, late in SWITCHES:
            monkeypatch.setattr(depthweave_decode, "TILES_COLUMNS", columns)
            monkeypatch.setattr(depthweave_decode, "TILES_AHEAD", ahead)
            monkeypatch.setattr(depthweave_decode, "TILES_INDEX", index)
            monkeypatch.setattr(depthweave_decode, "TILES_QUERY_LATE", late)
            switched = run()
            switches = dict(block=block, columns=columns, ahead=ahead, index=index, late=late)
            assert (switched - plain).abs().max().item() < 1e-5, switches
            assert (switched - twin).abs().max().item() < 1e-3, switches


@pytest.mark.parametrize("variant", ["tiles", "gather"])
def test_a_window_kept_for_a_cuda_graph_is_read_to_its_fill(tmp_path, variant):
    """The exact window as a CUDA graph keeps it (:mod:`kvweave.engine.graphs`): buffers of a capacity, the window's
    length on the device (``exact_fill``: the tokens before this step's, so ``fill + 1`` rows attended). Rows past it
    hold large numbers, so reading one would show; the kernel and the twin give what the window alone gives."""
    view, query, start, dim = _tiles_case(tmp_path, "dw-kernel")
    window = view.exact_k.shape[-2]
    kept = {}
    for name in ("exact_k", "exact_v"):
        held = getattr(view, name)
        buffer = torch.full((*held.shape[:2], window + 9, dim), 300.0, dtype=held.dtype, device=DEVICE)
        buffer[..., :window, :] = held
        kept[name] = buffer
    fill = torch.tensor([window - 1], dtype=torch.int32, device=DEVICE)
    static = attrs.evolve(view, exact_fill=fill, **kept)
    expected = torch_decode(view, query, start, dim**-0.5)
    assert (torch_decode(static, query, start, dim**-0.5) - expected).abs().max().item() < 1e-5
    got = fused_decode(static, query, start, dim**-0.5, split=96, variant=variant)
    assert (got - expected).abs().max().item() < 1e-3
    assert (fused_decode(attrs.evolve(static, exact_fill=None), query, start, dim**-0.5, variant=variant) - expected).abs().max().item() > 1e-2
    with pytest.raises(ValueError, match="fill must be int32"):
        fused_decode(attrs.evolve(static, exact_fill=fill.long()), query, start, dim**-0.5, variant=variant)


def test_the_tiles_pass_refuses_what_it_cannot_read_and_auto_takes_the_gather_pass(tmp_path):
    cache = filled(tmp_path, 4, 2, 64, 256, batch=1)
    view = decode_view(cache, 0)
    query = torch.randn(1, 4, 64, device=DEVICE)
    assert tiles_refusal(view) is None and pick_variant(view, "auto") == "tiles"
    level = view.k_levels[-1]
    odd = attrs.evolve(level, rank=6, packed=torch.zeros(3, 3, dtype=torch.uint8, device=DEVICE))
    for bad, words in ((odd, "rank 6"), (attrs.evolve(level, group=1), "channels a scale"),
                       (attrs.evolve(level, packed=torch.zeros(9, dtype=torch.uint8, device=DEVICE)[1:].view(2, 4)),
                        "aligned")):
        changed = attrs.evolve(view, k_levels=view.k_levels[:-1] + (bad,))
        assert words in tiles_refusal(changed)
        assert pick_variant(changed, "auto") == "gather"
        with pytest.raises(ValueError, match="tiles pass cannot read"):
            fused_decode(changed, query, None, 0.125, variant="tiles")
    empty = attrs.evolve(level, entries=0, group=level.rank)  # a level without entries: its group a guess
    assert tiles_refusal(attrs.evolve(view, k_levels=view.k_levels[:-1] + (empty,))) is None
    with pytest.raises(ValueError, match="unknown fused kernel variant 'fast'"):
        fused_decode(view, query, None, 0.125, variant="fast")
    with pytest.raises(ValueError, match="32 or 64 tokens"):
        fused_decode(view, query, None, 0.125, block_tokens=128, variant="tiles")


def recorded_tiles_launches(call) -> list[tuple[tuple, dict]]:
    """The tiles pass's launches (arguments, constants) that ``call()`` makes, recorded in order, the kernel not run
    (what runs after it reads buffers the pass never wrote)."""
    from kvweave.kernels import depthweave_tiles_triton as tiles_jit

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **constants: launches.append((args, constants))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tiles_jit, "_tiles_kernel", Recorder())
        call()
    return launches


def filled_view(tmp_path):
    """Layer 1's decode view of ``filled(tmp_path, 8, 2, 128, 320)`` (two rows, 8 query heads over 2 KV heads at
    head_dim 128), filled once a session: the tests that take it only read it."""
    if "filled" not in _TILES_VIEWS:
        _TILES_VIEWS["filled"] = decode_view(filled(tmp_path, 8, 2, 128, 320), 1)
    return _TILES_VIEWS["filled"]


def recorded_tiles_job(tmp_path) -> tuple[dict, dict]:
    """The build job (:func:`launch_job`) of the tiles pass as ``fused_decode`` launches it over a filled layer (the
    kernel recorded, not run), and the launch's constants."""
    from kvweave.kernels import depthweave_tiles_triton as tiles_jit

    view = filled_view(tmp_path)
    query = torch.randn(2, 8, 128, device=DEVICE)
    args, constants = recorded_tiles_launches(lambda: fused_decode(view, query, None, 0.125, variant="tiles"))[0]
    return launch_job(tiles_jit._tiles_kernel, args, constants), constants


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("switched", [False, True])
def test_the_tiles_pass_builds_for_a_gpu(tmp_path, monkeypatch, switched):
    """Built for sm_90 with the arguments the launcher passes, hardware population counts included; also with the
    residual words as columns and a step ahead (``TILES_COLUMNS``, ``TILES_AHEAD``)."""
    monkeypatch.setattr(depthweave_decode, "TILES_COLUMNS", switched)
    monkeypatch.setattr(depthweave_decode, "TILES_AHEAD", switched)
    job, constants = recorded_tiles_job(tmp_path)
    assert constants["COLUMNS"] == constants["AHEAD"] == switched
    job["constants"]["ASM"] = True
    built = compile_job(job)
    assert built["cubin"] > 0 and "popc" in built["ptx_text"]


@pytest.mark.parametrize("variant", ["gather", "tiles"])
def test_the_packed_logsumexp_matches_the_twin(tmp_path, variant):
    """The flush's statistics (log-sum-exp over the packed tokens of many query rows a head) by either pass."""
    view = filled_view(tmp_path)
    torch.manual_seed(2)
    queries = torch.randn(2, 8 * 8, 128, device=DEVICE)  # eight observed queries of each of 8 query heads
    expected = torch_packed_logsumexp(view, queries, 128**-0.5)
    got = fused_packed_logsumexp(view, queries, 128**-0.5, variant=variant)
    assert got.shape == (2, 64) and torch.isfinite(got).all()
    assert (got - expected).abs().max().item() < 1e-3


def test_the_flush_statistics_by_the_tiles_pass_read_no_value(tmp_path):
    """Without values the ``tiles`` pass writes each slot's maximum and sum as with them and leaves the output buffer
    untouched (the values' loads, products and stores are left out of the build), which is what
    ``fused_packed_logsumexp`` launches: it allocates no output buffer for it."""
    view = filled_view(tmp_path)
    torch.manual_seed(4)
    queries = torch.randn(2, 8 * 8, 128, device=DEVICE)
    n_seg = view.segments.shape[0]
    runs = {}
    for values in (True, False):
        m = torch.full((2 * 64 * n_seg,), float("nan"), device=DEVICE)
        l, acc = torch.full_like(m, float("nan")), torch.full((2 * 64 * n_seg, 128), float("nan"), device=DEVICE)
        start = torch.zeros(2, dtype=torch.int32, device=DEVICE)
        depthweave_decode._launch_tiles(view, queries, view.segments, start, m, l, acc, n_seg, 2, 32, 128,
                                        0.125 * depthweave_decode.LOG2E, 64, 1, values=values)
        runs[values] = (m, l, acc)
    assert torch.isfinite(runs[True][0]).all() and torch.isfinite(runs[True][1]).all()
    assert torch.isfinite(runs[True][2]).all() and runs[False][2].isnan().all()
    assert torch.equal(runs[True][0], runs[False][0]) and torch.equal(runs[True][1], runs[False][1])


def test_segments_cut_once_before_the_calls_read_what_a_split_per_call_reads(tmp_path):
    """``benchmarks/decode_kernel.py --split``: the view's segments cut once (``resplit``) and read as they are give
    ``fused_decode(..., split=)``'s output bit for bit (the script cuts them once: the cut reads the segments on the
    host, which a call replayed from a CUDA graph cannot)."""
    from kvweave.kernels.decode_view import resplit

    view, query, start, dim = _tiles_case(tmp_path, "dw-kernel")
    cut = attrs.evolve(view, segments=resplit(view.segments, 96))
    assert cut.segments.shape[0] > view.segments.shape[0]  # the split makes more programs than the cache's segments
    assert torch.equal(fused_decode(cut, query, start, dim**-0.5), fused_decode(view, query, start, dim**-0.5, split=96))
