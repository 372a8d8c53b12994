"""The built-in quantizers: packed sizes are what they claim, and the round trip stays within the
error bound of the format."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer
from kvweave.plugins.quantizers.passthrough import NoQuantizer
from kvweave.core.storage import tensor_bytes


@pytest.fixture
def vectors() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(2, 3, 50, 64) * torch.linspace(0.1, 5, 64)


def _stored(packed: dict[str, torch.Tensor]) -> int:
    return tensor_bytes(packed.values())


def test_int8_round_trip_within_half_a_step(vectors):
    quantizer = Int8BlockQuantizer(block=32)
    packed = quantizer.quantize(vectors)
    assert packed["codes"].dtype == torch.int8
    restored = quantizer.dequantize(packed, torch.float32)
    step = packed["scales"].float().repeat_interleave(32, dim=-1)
    assert torch.all((restored - vectors).abs() <= step / 2 + 1e-6)


def test_int4_round_trip_within_half_a_step(vectors):
    quantizer = Int4GroupQuantizer(group=16)
    packed = quantizer.quantize(vectors)
    assert packed["packed"].dtype == torch.uint8 and packed["packed"].shape[-1] == 32
    restored = quantizer.dequantize(packed, torch.float32)
    step = packed["scales"].float().repeat_interleave(16, dim=-1)
    assert torch.all((restored - vectors).abs() <= step / 2 + 1e-6)


@pytest.mark.parametrize(
    "quantizer",
    [Int8BlockQuantizer(), Int8BlockQuantizer(block=16), Int4GroupQuantizer(), Int4GroupQuantizer(group=8), NoQuantizer()],
    ids=repr,
)
def test_bytes_per_vector_matches_the_packed_nbytes(quantizer, vectors):
    packed = quantizer.quantize(vectors.to(torch.bfloat16))
    vectors_count = vectors[..., 0].numel()
    assert _stored(packed) == quantizer.bytes_per_vector(64, torch.bfloat16) * vectors_count


def test_int4_packs_two_codes_per_byte_and_reaches_the_extremes():
    x = torch.tensor([[7.0, -7.0, 0.0, 3.0]])
    quantizer = Int4GroupQuantizer(group=4)
    restored = quantizer.dequantize(quantizer.quantize(x), torch.float32)
    assert torch.allclose(restored, x)


def test_zero_groups_survive():
    x = torch.zeros(3, 64)
    for quantizer in (Int8BlockQuantizer(), Int4GroupQuantizer()):
        assert torch.equal(quantizer.dequantize(quantizer.quantize(x), torch.float32), x)


def test_widths_that_do_not_divide_are_refused_with_the_place_named():
    with pytest.raises(ModelError, match="slot X.*48"):
        Int4GroupQuantizer(group=32).check_width(48, "slot X")
    with pytest.raises(ModelError, match="slot Y"):
        Int8BlockQuantizer(block=48).check_width(64, "slot Y")


@pytest.mark.parametrize("kwargs", [{"group": 3}, {"group": 0}, {"group": "8"}, {"scale_dtype": "float8"}])
def test_invalid_int4_parameters(kwargs):
    with pytest.raises((TypeError, ValueError)):
        Int4GroupQuantizer(**kwargs)


def test_bool_is_not_an_integer_parameter():
    with pytest.raises(TypeError, match="block"):
        Int8BlockQuantizer(block=True)
