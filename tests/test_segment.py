"""``Segment``, the packed store's token-axis container: blocks joined along dim -2 through 3-D views (CUDA's batched
concatenation takes at most four dimensions; a five-dimensional store was copied element by element at each flush),
with the same result and the same refusals as ``torch.cat``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvweave.core.storage import Segment, cat_tokens


class _CatShapes(TorchDispatchMode):
    """The ranks of the tensors each ``aten::cat`` joins."""

    def __init__(self) -> None:
        super().__init__()
        self.ranks: list[list[int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten.cat:
            self.ranks.append([t.dim() for t in args[0]])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float16])
def test_blocks_join_as_torch_cat_joins_them_through_three_dimensional_views(dtype):
    old = torch.randint(0, 200, (2, 3, 4, 40, 16)).to(dtype)
    new = torch.randint(0, 200, (2, 3, 4, 16, 8)).to(dtype).transpose(-1, -2)  # a strided block of 8 tokens
    assert not new.is_contiguous()
    with _CatShapes() as seen:
        joined = cat_tokens(old, new)
    assert torch.equal(joined, torch.cat((old, new), dim=-2)) and joined.is_contiguous()
    assert seen.ranks == [[3, 3]]
    emptied = old[..., 40:, :]  # every token dropped from the front (sliding layers)
    assert torch.equal(cat_tokens(emptied, new), new) and torch.equal(cat_tokens(old, new[..., :0, :]), old)
    flat = torch.randn(5, 7, 3)
    assert torch.equal(cat_tokens(flat, flat[:, :2]), torch.cat((flat, flat[:, :2]), dim=-2))


def test_blocks_that_do_not_line_up_are_refused_as_torch_cat_refuses_them():
    old = torch.zeros(1, 2, 3, 10, 4)
    for new in (torch.zeros(1, 3, 2, 10, 4), torch.zeros(1, 2, 3, 10, 5)):  # the same element count, other shapes
        with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
            cat_tokens(old, new)


def test_a_segment_appends_block_by_block_with_rows_per_group():
    segment = Segment()
    blocks = [{"codes": torch.randint(0, 255, (1, 2, 3, 64, 32), dtype=torch.uint8),
               "scale": torch.randn(1, 2, 3, 1, 128).half()} for _ in range(3)]  # one scale row per 64 tokens
    for block in blocks:
        segment.append(block)
    assert segment.tokens == 192 and segment.strides == {"codes": 1, "scale": 64}
    for name in ("codes", "scale"):
        assert torch.equal(segment.fields[name], torch.cat([b[name] for b in blocks], dim=-2))
    assert segment.nbytes() == sum(t.nbytes for b in blocks for t in b.values())
