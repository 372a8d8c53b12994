"""``rotated-token`` ``token_tiles = 64``: the same 2- or 4-bit value codes stored in tiles of 64 tokens, channel by channel
in 32-bit words (``kvweave.kernels.formats.tile_codes``), the order the lowbit kernel's dense variant makes its value
operands from; a layout of its own name, the same bytes, whole tiles only."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.errors import ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache
from kvweave.kernels.formats import tile_codes, untile_codes
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

from conftest import tiny_llama, write_registry


@pytest.mark.parametrize("bits", [2, 4])
def test_each_slot_lies_in_the_word_and_bits_the_layout_names(bits):
    """2 bits: slot ``t = 16 s + 8 h + 2 q + e`` of channel ``c`` is code ``8 h + 4 e + s`` of word ``q`` of that
    channel; 4 bits: slot ``t = 32 w + 16 s + 8 h + 2 q + e`` is code ``4 e + 2 h + s`` of word ``4 w + q``. The 32-bit
    words read back from the packed bytes give each slot's code where the kernel takes it."""
    from kvweave.plugins.quantizers._bitpack import pack

    codes = torch.randint(0, 1 << bits, (2, 128, 8), generator=torch.Generator().manual_seed(0))
    words = pack(tile_codes(codes, bits), bits).view(torch.int32).reshape(2, 2, 8, 2 * bits)  # row, tile, channel, word
    for t in range(64):
        if bits == 2:
            word, place = (t // 2) % 4, 8 * ((t // 8) % 2) + 4 * (t % 2) + t // 16
        else:
            word, place = 4 * (t // 32) + (t // 2) % 4, 4 * (t % 2) + 2 * ((t // 8) % 2) + (t // 16) % 2
        got = (words[:, 1, :, word] >> (bits * place)) & ((1 << bits) - 1)
        assert torch.equal(got.long(), codes[:, 64 + t, :]), t
    assert torch.equal(untile_codes(tile_codes(codes, bits), bits), codes)
    assert not torch.equal(untile_codes(tile_codes(codes, bits), 6 - bits), codes)  # the other width's order differs
    tiled = RotatedTokenQuantizer(bits=bits, token_tiles=64).quantize(torch.randn(2, 128, 8))
    assert tiled["codes"].shape == (2, 2, bits * 8 * 8) and tiled["codes"].dtype == torch.uint8


@pytest.mark.parametrize("scale_format, bits, levels", [("float16", 2, "normal"), ("log8", 2, "normal"),
                                                        ("log8", 4, "uniform")])
def test_tiles_store_the_same_bytes_and_restore_the_same_vectors(scale_format, bits, levels):
    x = torch.randn(2, 3, 192, 64, generator=torch.Generator().manual_seed(1))
    flat = RotatedTokenQuantizer(bits=bits, scale_format=scale_format, levels=levels)
    tiled = RotatedTokenQuantizer(bits=bits, scale_format=scale_format, levels=levels, token_tiles=64)
    a, b = flat.quantize(x), tiled.quantize(x)
    assert tiled.packed_format == ("rotated-token-tiled.v1" if scale_format == "float16" else "rotated-token-log8-tiled.v1")
    assert sum(t.nbytes for t in a.values()) == sum(t.nbytes for t in b.values())
    assert b["codes"].shape == (2, 3, 3, 512 * bits) and not torch.equal(a["codes"].flatten(), b["codes"].flatten())
    assert torch.equal(flat.dequantize(a, torch.float32), tiled.dequantize(b, torch.float32))
    assert tiled.tokens_per_group() == 64 and tiled.bytes_per_vector(64, torch.float16) == flat.bytes_per_vector(64, torch.float16)


def test_tiles_take_two_or_four_bit_codes_and_whole_tiles():
    with pytest.raises(ValueError, match="token_tiles = 64 stores 2- or 4-bit codes, one width for every layer; got bits \\[3\\]"):
        RotatedTokenQuantizer(bits=3, token_tiles=64)
    with pytest.raises(ValueError, match="got bits \\[2, 4\\]"):
        RotatedTokenQuantizer(bits=2, token_tiles=64, layer_bits=(2, 4))
    with pytest.raises(ValueError, match="'token_tiles' must be one of 0, 64"):
        RotatedTokenQuantizer(bits=2, token_tiles=32)
    with pytest.raises(ModelError, match="whole tiles of tokens; got 40 tokens"):
        RotatedTokenQuantizer(bits=2, token_tiles=64).quantize(torch.randn(1, 40, 64))


def test_a_pipeline_with_tiles_needs_blocks_of_whole_tiles_and_a_kernel_that_reads_them(tmp_path):
    path = write_registry(tmp_path, "tiles", """
[pipelines.v-tiles-pre]
extends = "prerope-k4v2-lowbit"
values.quantizer.token_tiles = 64
kernel.backend = "triton"

[pipelines.v-tiles-short]
extends = "prerope-qa3v2"
block_tokens = 32
keys.quantizer.group = 32
values.quantizer = { bits = 2, token_tiles = 64 }
""")
    with pytest.raises(ModelError, match=r"slot 'values.quantizer' \('rotated-token'\): it packs groups of 64 tokens"):
        build_cache(load_pipeline("v-tiles-short", path), tiny_llama(torch.float32, hidden=256))
    with pytest.raises(ModelError, match="read on a GPU by the 'dense' kernel only.*keys channel-group.v1 at 4 bits.*head_dim 64"):
        build_cache(load_pipeline("v-tiles-pre", path), tiny_llama(torch.float32, hidden=256))
