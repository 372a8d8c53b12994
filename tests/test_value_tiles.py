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

from conftest import CharTokenizer, tiny_llama, write_registry


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
    with pytest.raises(ValueError, match="token_tiles = 64 stores 2- or 4-bit codes \\(a width per layer among them\\); got bits \\[3\\]"):
        RotatedTokenQuantizer(bits=3, token_tiles=64)
    with pytest.raises(ValueError, match="got bits \\[2, 3, 4\\]"):
        RotatedTokenQuantizer(bits=2, token_tiles=64, layer_bits=(2, 4, 3))
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


def test_a_width_and_levels_per_layer_are_each_layers_own(tmp_path):
    """``layer_bits`` and ``layer_levels`` give each layer its quantizer: 4-bit uniform codes where the tables say so, 2-bit
    normal ones elsewhere, tiles for both; tables of different lengths, an unknown level and a table that is not a list
    are refused by name."""
    quantizer = RotatedTokenQuantizer(bits=2, token_tiles=64, layer_bits=[4, 2], layer_levels=["uniform", "normal"])
    wide, narrow = quantizer.for_layer(0), quantizer.for_layer(1)
    assert (wide.bits, wide.levels, narrow.bits, narrow.levels) == (4, "uniform", 2, "normal")
    assert not wide.layer_bits and not wide.layer_levels
    x = torch.randn(1, 2, 128, 64, generator=torch.Generator().manual_seed(6))
    assert wide.quantize(x)["codes"].nbytes == 2 * narrow.quantize(x)["codes"].nbytes
    wide_error = (wide.dequantize(wide.quantize(x), torch.float32) - x).norm()
    assert wide_error < 0.5 * (narrow.dequantize(narrow.quantize(x), torch.float32) - x).norm()
    levels_only = RotatedTokenQuantizer(bits=4, layer_levels=["normal", "uniform"])
    assert (levels_only.for_layer(0).bits, levels_only.for_layer(1).levels) == (4, "uniform")
    with pytest.raises(ValueError, match="layer_bits \\(2 entries\\) and layer_levels \\(3 entries\\)"):
        RotatedTokenQuantizer(layer_bits=[2, 4], layer_levels=["normal"] * 3)
    with pytest.raises(ValueError, match="'layer_levels' entry 1 \\(layer 1\\).*'levels' must be one of"):
        RotatedTokenQuantizer(layer_levels=["normal", "gaussian"])
    with pytest.raises(TypeError, match="per-layer table of names must be a list of strings"):
        RotatedTokenQuantizer(layer_levels="uniform")
    path = write_registry(tmp_path, "levels", """
[pipelines.t-short-table]
extends = "prerope-qa3v2"
values.quantizer.layer_levels = ["normal", "uniform"]
""")
    with pytest.raises(ModelError, match="layer_levels has 2 entries but the model has 3 layers"):
        build_cache(load_pipeline("t-short-table", path), tiny_llama(torch.float32))


@pytest.mark.interpreter
def test_layers_of_four_and_two_bit_values_in_tiles_decode_through_the_dense_kernel(tmp_path):
    """A pipeline whose values take 4-bit uniform codes in one layer and 2-bit normal ones in the other, both in tiles
    (``layer_bits``, ``layer_levels``): each layer's storage is its own width, the default launch gives both to the
    dense kernel, and it decodes each as the torch twin does."""
    from kvweave.engine import importance
    from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, resolve_variant, torch_lowbit_decode

    path = write_registry(tmp_path, "mixed", """
[pipelines.t-kzd-vq]
extends = "kvzip-qa35v3"
key_space = "post-rope"
keys.quantizer = { use = "channel-group", bits = 4, group = 64, outliers = 0 }
values.quantizer = { bits = 2, token_tiles = 64, layer_bits = [4, 2], layer_levels = ["uniform", "normal"] }
evictor.fraction = 0.48
router.rank = 128
kernel.use = "lowbit"
""")
    net = tiny_llama(layers=2, hidden=512)  # head_dim 128
    cache = build_cache(load_pipeline("t-kzd-vq", path), net, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(net, cache, torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4)))
    q = torch.randn(1, 4, 128, generator=torch.Generator().manual_seed(5))
    codes = []
    for layer, bits in ((0, 4), (1, 2)):
        view = cache.engine.kernel.lowbit_view(cache.engine.view(layer), torch.device("cpu"))
        assert view.v_bits == bits and view.v_tiled and resolve_variant(view, "auto") == ("dense", 64)
        codes.append(view.v_codes[0, :64].numel())
        twin = torch_lowbit_decode(view, q, None, 128 ** -0.5)
        out = lowbit_decode(view, q, None, 128 ** -0.5)
        assert torch.allclose(out, twin, atol=1e-5) and float(twin.abs().max()) > 0.05, (layer, (out - twin).abs().max())
        assert plan_launch(view, q, None, 128 ** -0.5).constants["VBITS"] == bits
    assert codes[0] == 2 * codes[1]  # the 4-bit layer stores twice the code bytes a token
