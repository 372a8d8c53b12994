"""The ``lowbit`` combine undoing a Hadamard rotation by a fast Walsh-Hadamard transform (``HAD``,
``COMBINE_HADAMARD``): the rotation's structure it relies on, which views take it, and its output against the matrix's
under Triton's interpreter (CI) and on a GPU at a real size."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, importance
from kvweave.kernels import lowbit_combine
from kvweave.kernels.lowbit_decode import plan_combine, plan_launch, torch_lowbit_decode
from kvweave.plugins.quantizers.rotated_token import hadamard, rotation_matrix

from conftest import CharTokenizer, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "benchmarks" / "dense_sweep.toml"


@pytest.mark.parametrize("width, seed", [(64, 0), (128, 0), (128, 7), (256, 3)])
def test_a_hadamard_rotation_is_the_sylvester_matrix_times_its_first_row(width, seed):
    """What the transform relies on: each column of ``rotated-token``'s Hadamard rotation is the Sylvester matrix's
    column times one scale, the matrix's first row (H's first row is all ones)."""
    q = rotation_matrix("hadamard", seed, width).double()
    assert torch.equal(q, hadamard(width).double() * q[0])
    assert torch.allclose(q.abs(), torch.full_like(q, width ** -0.5)) and len(set(q[0].sign().tolist())) == 2
    random = rotation_matrix("random", seed, width).double()
    assert not torch.allclose(random, hadamard(width).double() * random[0], atol=1e-3)


def _sinks_view(dim: int):
    """Layer 1 of a 300-token prompt through the 8x storage (a Hadamard rotation; head_dim ``dim``, at 128 its values
    in tiles): sinks restored exactly, an exact window."""
    net = tiny_llama(layers=2, hidden=4 * dim)
    name = {64: "kzd-k4v2-f48", 128: "kzd-k4v2t-f48-d128", 256: "kzd-k4v2t-f48-d256"}[dim]  # sinks' rank: head_dim
    cache = build_cache(load_registry(SWEEP).resolve(name), net, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(net, cache, torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4)))
    return cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))


def _packed(view, q, start=None):
    """The dense kernel's packed pass as ``lowbit_decode(view, q, start, ..., variant="dense")`` launches it, run: what
    its combine reads. The pass never reads the values' rotation, so one run serves the combine by the transform and
    the one by the matrix (the combine only reads the pass's outputs)."""
    packed = plan_launch(view, q, start, q.shape[-1] ** -0.5, variant="dense")
    packed.run()
    return packed


def _combined(view, q, start, packed, out_dtype=None):
    """``lowbit_decode``'s output for ``view`` from its packed pass ``packed`` (:func:`_packed`): the combine run."""
    return plan_combine(view, q, start, q.shape[-1] ** -0.5, packed, out_dtype).run()[0]


def _as_the_matrix_and_the_twin(view, q, start=None):
    """The dense kernel's output with the transform: the matrix's to float32 rounding (the same packed pass combined
    both ways), the twin's within its tolerance; returned with the packed pass."""
    packed = _packed(view, q, start)
    fast = _combined(view, q, start, packed)
    slow = _combined(attrs.evolve(view, rotation_hadamard=False), q, start, packed)
    assert torch.allclose(fast, slow, atol=2e-6, rtol=0), (fast - slow).abs().max()
    twin = torch_lowbit_decode(view, q, start, q.shape[-1] ** -0.5)
    assert torch.allclose(fast, twin, atol=1e-5), (fast - twin).abs().max()
    return fast, packed


@pytest.fixture(scope="module")
def sinks_view():
    return _sinks_view(128)


def test_the_plugins_view_says_its_rotation_is_hadamard_and_the_launch_takes_the_transform(sinks_view, monkeypatch):
    """The lowbit plugin's view of a ``rotated-token`` layer with ``rotation = "hadamard"`` (the default) carries the
    flag, and the per-query-head combine takes log2(head_dim) stages; a view without the flag, a combine in slices, or
    the setting off read the matrix (HAD = 0)."""
    view = sinks_view
    assert view.rotation_hadamard and view.rotation.shape == (128, 128)
    q = torch.randn(1, 8, 128, generator=torch.Generator().manual_seed(5))
    had = lambda v: plan_combine(v, q, None, 0.1, plan_launch(v, q, None, 0.1, variant="dense")).constants["HAD"]  # noqa: E731
    assert had(view) == 7
    assert had(attrs.evolve(view, rotation_hadamard=False)) == 0
    monkeypatch.setattr(lowbit_combine, "COMBINE_SLICES", 4)
    assert had(view) == 0
    monkeypatch.setattr(lowbit_combine, "COMBINE_SLICES", 1)
    monkeypatch.setattr(lowbit_combine, "COMBINE_HADAMARD", 0)
    assert had(view) == 0


@pytest.mark.interpreter
@pytest.mark.parametrize("dim", [64, 128])
def test_the_transform_gives_the_matrixs_output(dim):
    """Restored sinks, the exact window, with and without a first visible position, float32 and the model's dtype:
    the transform's output is the matrix's to float32 rounding and the twin's within its tolerance; the flag on a
    rotation that is not Hadamard's (a random orthogonal one) changes the output, so the test would see a transform
    that did nothing or the wrong thing. head_dim 64 and 128: 6 and 7 stages."""
    view = _sinks_view(dim)
    assert view.rotation_hadamard and view.rotation.shape == (dim, dim)
    q = torch.randn(1, 8, dim, generator=torch.Generator().manual_seed(5))
    launch = plan_launch(view, q, None, dim ** -0.5, variant="dense")
    assert plan_combine(view, q, None, dim ** -0.5, launch).constants["HAD"] == int(math.log2(dim))
    for start in (None, torch.tensor([30], dtype=torch.int32)):
        fast, packed = _as_the_matrix_and_the_twin(view, q, start)
        low = _combined(view, q, start, packed, out_dtype=torch.bfloat16)
        assert low.dtype == torch.bfloat16 and torch.allclose(low.float(), fast, atol=1e-2)
    wrong = attrs.evolve(view, rotation=rotation_matrix("random", 1, dim))  # the packed pass reads no rotation
    packed = _packed(wrong, q)
    assert (_combined(wrong, q, None, packed) - _combined(attrs.evolve(wrong, rotation_hadamard=False), q, None, packed)
            ).abs().max() > 1e-3


@pytest.mark.interpreter
@pytest.mark.parametrize("q_heads, dim", [(2, 128), (6, 128), (8, 128), (4, 256)])
def test_the_combine_by_kv_head_gives_the_matrixs_output(sinks_view, monkeypatch, q_heads, dim):
    """The combine by KV head (taken here at every size), 1, 3 and 4 query heads a KV head (3: a padded row of the
    tile), restored sinks and the exact window, head_dim 128 and 256: the transform's output is the matrix's, and the
    twin's."""
    monkeypatch.setattr(lowbit_combine, "COMBINE_GROUP_ROWS", 0)
    view = sinks_view if dim == 128 else _sinks_view(dim)
    q = torch.randn(1, q_heads, dim, generator=torch.Generator().manual_seed(q_heads))
    combine = plan_combine(view, q, None, dim ** -0.5, plan_launch(view, q, None, dim ** -0.5, variant="dense"))
    assert "QR" in combine.constants and combine.constants["HAD"] == int(math.log2(dim))
    _as_the_matrix_and_the_twin(view, q)


@pytest.mark.interpreter
@pytest.mark.parametrize("dim", [256, 128])
def test_past_one_tile_of_splits_the_transform_is_taken_in_the_splits_loop(dim, monkeypatch):
    """Past ``WHOLE`` (head_dim 256; at 128, more splits than ``COMBINE_WHOLE_SPLITS``, here 1) the per-query-head
    combine merges the splits in tiles, every channel in one chunk, and transforms the result: the matrix's output,
    and the twin's."""
    if dim == 128:
        monkeypatch.setattr(lowbit_combine, "COMBINE_WHOLE_SPLITS", 1)
    view = _sinks_view(dim)
    assert view.rotation_hadamard and view.rotation.shape == (dim, dim)
    q = torch.randn(1, 4, dim, generator=torch.Generator().manual_seed(3))
    combine = plan_combine(view, q, None, dim ** -0.5, plan_launch(view, q, None, dim ** -0.5, variant="dense"))
    assert not combine.constants["WHOLE"] and combine.constants["HAD"] == int(math.log2(dim))
    assert combine.constants["CB"] == dim
    _as_the_matrix_and_the_twin(view, q)


@pytest.mark.interpreter
def test_the_benchmarks_storage_takes_the_transform():
    """``benchmarks/lowbit_kernel.py``'s 8x storage (a Hadamard rotation, flagged), one and three rows, splits read in
    one tile: the transform's output is the matrix's."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lowbit_kernel

    for rows in (1, 3):
        view = attrs.evolve(lowbit_kernel.packed_view(rows, 320, device="cpu", storage="k4v2e48t"), inv_freq=None)
        q = torch.randn(rows, lowbit_kernel.Q_HEADS, 128, generator=torch.Generator().manual_seed(rows))
        launch = plan_launch(view, q, None, 128 ** -0.5, variant="dense")
        combine = plan_combine(view, q, None, 128 ** -0.5, launch)
        assert combine.constants["HAD"] == 7 and combine.constants["WHOLE"] and launch.grid[1] >= 2  # splits to combine
        launch.run()  # lowbit_decode's packed pass, combined by the transform and by the matrix
        fast = combine.run()[0]
        slow = _combined(attrs.evolve(view, rotation_hadamard=False), q, None, launch)
        assert torch.allclose(fast, slow, atol=2e-6, rtol=0), (fast - slow).abs().max()


_GPU = """
import sys, attrs, torch
sys.path.insert(0, "benchmarks")
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view
from kvweave.kernels.lowbit_decode import lowbit_decode
worst = 0.0
for storage in ("k4v2e48t", "k4v4e77t"):
    for rows in (1, 8, 32, 40):  # 40 rows: the combine by KV head (320 rows of 8 KV heads)
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage), inv_freq=None)
        q = torch.randn(rows, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(5)).cuda()
        fast = lowbit_decode(view, q, None, HEAD_DIM ** -0.5, variant="dense")
        slow = lowbit_decode(attrs.evolve(view, rotation_hadamard=False), q, None, HEAD_DIM ** -0.5, variant="dense")
        assert float(fast.abs().max()) > 0.05
        worst = max(worst, float((fast - slow).abs().max() / fast.abs().max()))
for storage in ("k4v2e48t", "k4v4e77t"):  # head_dim 256: the splits merged in tiles, then the transform
    for rows in (1, 8, 40):  # 40 rows: the combine by KV head
        view = attrs.evolve(packed_view(rows, 32768, device="cuda", storage=storage, shape="d256"), inv_freq=None)
        q = torch.randn(rows, 16, 256, generator=torch.Generator().manual_seed(5)).cuda()
        fast = lowbit_decode(view, q, None, 256 ** -0.5, variant="dense")
        slow = lowbit_decode(attrs.evolve(view, rotation_hadamard=False), q, None, 256 ** -0.5, variant="dense")
        assert float(fast.abs().max()) > 0.05
        worst = max(worst, float((fast - slow).abs().max() / fast.abs().max()))
print(worst)
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the combine for a CUDA GPU")
def test_the_transform_gives_the_matrixs_output_on_the_gpu():
    """Llama-3-8B attention shape, 32,768 tokens before eviction, both storages, B = 1, 8, 32 (a program a query
    head) and 40 (a program a KV head), and head_dim 256 at B = 1, 8 and 40 (16 query heads on 8 KV heads):
    the transform's output is the matrix's up to float32 rounding (1e-5 of the output's largest value)."""
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _GPU], capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.split()[-1]) <= 1e-5
