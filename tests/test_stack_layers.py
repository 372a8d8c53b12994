"""``kvweave.core.storage.stack_layers``: a group's block from its layers' window tokens, as ``torch.stack`` gives it."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.storage import stack_layers


def test_token_major_views_stack_as_torch_stack_does():
    # as a model's projections leave them: [B, n, H, D] transposed to [B, H, n, D], the first tokens read
    parts = [torch.randn(2, 40, 3, 16).to(torch.bfloat16).transpose(1, 2)[..., :33, :] for _ in range(4)]
    block = stack_layers(parts)
    assert block.is_contiguous() and block.dtype == torch.bfloat16
    assert torch.equal(block, torch.stack(parts))


def test_one_part_is_a_view_and_mismatched_parts_are_refused():
    part = torch.randn(1, 2, 5, 8)
    alone = stack_layers([part])
    assert alone.shape == (1, 1, 2, 5, 8) and alone.data_ptr() == part.data_ptr()
    with pytest.raises(ValueError, match="part 1 is torch.float32 \\(1, 2, 4, 8\\)"):
        stack_layers([part, part[..., :4, :]])
    with pytest.raises(ValueError, match="part 1 is torch.bfloat16"):
        stack_layers([part, part.bfloat16()])


def test_a_dtype_converts_each_part_as_it_is_copied():
    """``dtype``: the same numbers as ``torch.stack(parts).to(dtype)``, in a buffer of that dtype; one part converted
    too (a new tensor where the dtype differs, the part's own storage where it does not)."""
    parts = [torch.randn(2, 40, 3, 16).to(torch.bfloat16).transpose(1, 2)[..., :33, :] for _ in range(3)]
    block = stack_layers(parts, torch.float32)
    assert block.dtype == torch.float32 and block.is_contiguous()
    assert torch.equal(block, torch.stack(parts).to(torch.float32))
    alone = stack_layers(parts[:1], torch.float32)
    assert alone.dtype == torch.float32 and alone.data_ptr() != parts[0].data_ptr()
    assert torch.equal(alone, parts[0].unsqueeze(0).float())
    same = stack_layers(parts[:1], torch.bfloat16)
    assert same.data_ptr() == parts[0].data_ptr()
