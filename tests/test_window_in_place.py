"""The exact window kept in buffers of a capacity for CUDA graphs (``ExactTokens.make_static``): it holds and reads
back what the appending window does, by the put kernel or in torch, refuses whatever would move it, and the ``lowbit``
combine reads its length from the device. (Graph decoding itself: tests/test_graphs.py.)"""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.core.errors import CacheStateError
from kvweave.engine import build_cache, importance
from kvweave.engine.exact import ExactTokens
from kvweave.kernels.lowbit_decode import lowbit_decode, torch_lowbit_decode

from conftest import CharTokenizer
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


def _finite_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


@pytest.mark.interpreter
@pytest.mark.parametrize("by", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_window_kept_in_place_holds_and_reads_back_what_the_appending_window_does(dtype, by):
    """A window kept in buffers takes each decode token in place (by the put kernel, or off a GPU by its arithmetic in
    torch) and holds and reads back what the appending window (its kernel) does, NaN, zero and large tokens included."""
    torch.manual_seed(3)
    prompt = (torch.randn(2, 3, 20, 64) * 4).to(dtype)
    eager, kept = ExactTokens("int8"), ExactTokens("int8")
    eager.fused = True
    kept.fused = True if by == "kernel" else None  # None: the torch arithmetic, the tokens being on a CPU
    for held in (eager, kept):
        held.append("keys", prompt)
        held.append("values", -prompt)
    fill = torch.full((1,), 20, dtype=torch.int32)
    kept.make_static(27, fill)
    assert kept.static and kept.tokens() == 20
    assert kept.nbytes() == sum(t.nbytes for t in kept.stored()) > eager.nbytes()  # the capacity and read-back count
    for step in range(7):
        new = (torch.randn(2, 3, 1, 64) * 10.0 ** (step - 2)).to(dtype)
        if step == 3:
            new[1, 2, 0, 9] = float("nan")
        if step == 4:
            new[0, 0] = 0  # a zero vector: scale 0
        for kind in ("keys", "values"):
            sign = 1 if kind == "keys" else -1
            expected = eager.append_read(kind, sign * new)
            got = kept.append_read(kind, sign * new)
            assert got.shape == (2, 3, 27, 64)  # the buffer, the same tensor every step
            assert got is kept.read_buffer(kind)
            assert _finite_equal(got[..., : 21 + step, :], expected)  # this step's token as it arrived, the rest read back
        fill += 1
        kept.advance()
        assert kept.tokens() == eager.tokens() == 21 + step
        for kind in ("keys", "values"):
            (codes_e, scale_e), (codes_k, scale_k) = eager._held[kind], kept._held[kind]
            assert _finite_equal(scale_e, scale_k) and torch.equal(codes_e * scale_e.isfinite(), codes_k * scale_k.isfinite())
    assert float(kept._worst) == float(eager._worst)
    with pytest.raises(CacheStateError, match="holds at most 27"):
        kept.advance()
    kept.end_static()
    assert not kept.static and kept.nbytes() == eager.nbytes()
    assert all(t.untyped_storage().nbytes() == t.nbytes for t in kept.stored())  # copies, not views of the buffers
    for kind in ("keys", "values"):
        assert _finite_equal(kept[kind], eager[kind])


def test_a_window_of_the_tokens_as_they_arrived_is_kept_in_place_too():
    torch.manual_seed(4)
    eager, kept = ExactTokens("input"), ExactTokens("input")
    prompt = torch.randn(1, 2, 6, 32)
    for held in (eager, kept):
        held.append("keys", prompt)
        held.append("values", -prompt)
    fill = torch.full((1,), 6, dtype=torch.int32)
    kept.make_static(10, fill)
    assert kept.nbytes() == 2 * 10 * 2 * 32 * 4  # each kind's buffer at its capacity, its own read-back
    for _ in range(4):
        new = torch.randn(1, 2, 1, 32)
        for kind in ("keys", "values"):
            expected, got = eager.append_read(kind, new), kept.append_read(kind, new)
            assert got is kept.read_buffer(kind) and torch.equal(got[..., : expected.shape[-2], :], expected)
        fill += 1
        kept.advance()
    kept.end_static()
    assert kept.nbytes() == eager.nbytes() and all(torch.equal(kept[k], eager[k]) for k in ("keys", "values"))


@pytest.mark.interpreter
def test_a_window_kept_in_place_refuses_whatever_would_move_it():
    held = ExactTokens("int8")
    with pytest.raises(CacheStateError, match="empty window"):
        held.make_static(8, torch.zeros(1, dtype=torch.int32))
    for kind in ("keys", "values"):
        held.append(kind, torch.randn(1, 2, 5, 64))
    with pytest.raises(CacheStateError, match="capacity above it"):
        held.make_static(5, torch.full((1,), 5, dtype=torch.int32))
    with pytest.raises(CacheStateError, match="int32"):
        held.make_static(9, torch.full((1,), 5, dtype=torch.int64))
    held.make_static(9, torch.full((1,), 5, dtype=torch.int32))
    for what, act in (("appended to", lambda: held.append("keys", torch.randn(1, 2, 1, 64))),
                      ("shortened", lambda: held.drop_front("keys", 1)),
                      ("reordered", lambda: held.select_rows(torch.tensor([0]))),
                      ("one decode token", lambda: held.append_read("keys", torch.randn(1, 2, 2, 64)))):
        with pytest.raises(CacheStateError, match=what):
            act()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["t-lowbit-post", "t-lowbit-sinks-kvzip"])
def test_the_combine_reads_the_windows_length_from_the_device(model, registry, name):  # noqa: F811 - fixtures imported
    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(5)))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    held = view.exact_k.shape[-2]
    assert held > 2 and view.tokens > 0
    q = torch.randn(1, 4, view.exact_k.shape[-1], generator=torch.Generator().manual_seed(6))
    scaling = view.exact_k.shape[-1] ** -0.5

    def kept(tensor):  # the window in a buffer of 9 more rows, what lies beyond it large enough to show if read
        buffer = torch.randn(*tensor.shape[:2], held + 9, tensor.shape[-1], generator=torch.Generator().manual_seed(7)) * 50
        buffer[..., :held, :] = tensor
        return buffer

    in_place = attrs.evolve(view, exact_k=kept(view.exact_k), exact_v=kept(view.exact_v),
                            exact_fill=torch.full((1,), held - 1, dtype=torch.int32))
    for decode in (lambda v: torch_lowbit_decode(v, q, None, scaling), lambda v: lowbit_decode(v, q, None, scaling)):
        expected = decode(view)
        torch.testing.assert_close(decode(in_place), expected, rtol=1e-5, atol=1e-5)
        shorter = decode(attrs.evolve(in_place, exact_fill=torch.full((1,), held - 2, dtype=torch.int32)))
        assert not torch.allclose(shorter, expected, atol=1e-4)  # the count decides which rows are attended
