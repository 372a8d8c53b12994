"""A flushed block's codes computed and packed by one Triton kernel (``kvweave.kernels.pack``): ``channel-alloc`` and
``rotated-token`` (normal levels) store the same bytes with the kernels as with their torch paths, for the shapes and
settings the pipelines use; the kernels refuse what they cannot pack, and build for a GPU (Triton's interpreter on a
CPU; on a GPU the quantizers take them for every CUDA tensor)."""

from __future__ import annotations

import pytest
import torch

from kvweave.kernels import pack
from kvweave.plugins.quantizers._bitpack import normal_edges
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

from test_lowbit_kernel_host import SHARED_LIMIT, _nvidia_backend, compile_for_gpu


def _both(monkeypatch, quantizer, x, **kwargs) -> tuple[dict, dict]:
    """``quantizer.quantize(x)`` by the torch path and by the kernel."""
    monkeypatch.setattr(pack, "FORCE", False)
    by_torch = quantizer.quantize(x, **kwargs)
    monkeypatch.setattr(pack, "FORCE", True)
    by_kernel = quantizer.quantize(x, **kwargs)
    return by_torch, by_kernel


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for field in a:
        assert a[field].dtype == b[field].dtype and torch.equal(a[field], b[field]), field


def _keys(shape, dtype, seed) -> torch.Tensor:
    """Pre-RoPE-like keys: channels of very different ranges, a few large entries (outliers), a constant channel."""
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1]
    x = torch.randn(*shape, generator=gen) * torch.logspace(-2, 1, width)
    x[..., 3] = 0.25  # a channel of zero range in every group (scale 0)
    x.view(-1, width)[:: 7, 5] *= 40  # outliers
    return x.to(dtype)


@pytest.mark.interpreter
@pytest.mark.parametrize("settings", [
    dict(mean_bits=3.5), dict(mean_bits=3.0, outliers=0), dict(mean_bits=2.25, outliers=2, pairs=False),
    dict(mean_bits=4.0, group=32), dict(mean_bits=3.5, group=16, max_bits=5),
])
@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_channel_alloc_packs_the_same_bytes_with_the_kernel(monkeypatch, settings, dtype, width):
    quantizer = ChannelAllocQuantizer(**settings)
    x = _keys((2, 3, 128, width), dtype, seed=width)
    by_torch, by_kernel = _both(monkeypatch, quantizer, x)
    _same(by_torch, by_kernel)
    assert bool((by_kernel["bits"] == 0).any()) or settings.get("mean_bits", 3.5) >= 3.5  # zero-width channels met
    assert torch.equal(quantizer.dequantize(by_kernel, torch.float32), quantizer.dequantize(by_torch, torch.float32))


@pytest.mark.interpreter
@pytest.mark.parametrize("settings", [
    dict(bits=4, group=64, outliers=0), dict(bits=3, group=32), dict(bits=2, group=16, outliers=2),
])
@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 128), (torch.float32, 64)])
def test_channel_group_packs_the_same_bytes_with_the_kernel(monkeypatch, settings, dtype, width):
    """Uniform levels, every channel ``bits`` wide: the channel-alloc kernel's stream is ``pack``'s layout."""
    quantizer = ChannelGroupQuantizer(**settings)
    x = _keys((2, 3, 128, width), dtype, seed=width + settings["bits"])
    called = []
    monkeypatch.setattr(pack, "affine_varwidth", lambda *a, original=pack.affine_varwidth: called.append(1) or original(*a))
    by_torch, by_kernel = _both(monkeypatch, quantizer, x)
    assert called == [1]  # the kernel's path only
    _same(by_torch, by_kernel)
    assert torch.equal(quantizer.dequantize(by_kernel, torch.float32), quantizer.dequantize(by_torch, torch.float32))


@pytest.mark.interpreter
@pytest.mark.parametrize("quantizer, width", [
    (ChannelGroupQuantizer(bits=4, group=64, outliers=0), 256),  # 128 bytes a token: two parts of 128 channels
    (ChannelAllocQuantizer(mean_bits=6.0, max_bits=8, group=32), 256),  # up to 256 bytes: parts of 64 channels
    (ChannelAllocQuantizer(mean_bits=3.5, group=32, outliers=0), 512),  # each part's first bit after the widths before it
    (RotatedTokenQuantizer(bits=4, symmetric=False), 256),
    (RotatedTokenQuantizer(bits=3, scale_format="log8"), 512),
])
def test_wide_heads_are_packed_in_parts_to_the_same_bytes(monkeypatch, quantizer, width):
    """head_dim 256 and 512: the kernels take the channels in parts (:data:`kvweave.kernels.pack.ONE_HOT_ELEMENTS`),
    each part's codes put in at the bits the widths before it end at; the same bytes as the torch path."""
    x = _keys((1, 2, 64, width), torch.bfloat16, seed=width)
    by_torch, by_kernel = _both(monkeypatch, quantizer, x)
    _same(by_torch, by_kernel)
    size = by_kernel["codes"].shape[-1]
    assert pack._channel_part(width, pack._bytes_tile(size)) < width  # more than one part


def test_a_packing_kernel_takes_its_channels_whole_where_the_operands_are_small():
    assert pack._channel_part(128, pack._bytes_tile(64)) == 128  # head_dim 128 at 4 bits: one part, as before
    assert pack._channel_part(256, pack._bytes_tile(128)) == 128
    assert pack._channel_part(256, pack._bytes_tile(256)) == 64
    assert pack._channel_part(16, 4096) == 16  # never below a product's side


@pytest.mark.interpreter
def test_channel_group_normal_levels_and_odd_groups_keep_the_torch_path(monkeypatch):
    monkeypatch.setattr(pack, "affine_varwidth", lambda *a, **k: pytest.fail("the kernel was called"))
    x = torch.randn(1, 2, 72, 64)
    for quantizer in (ChannelGroupQuantizer(bits=4, group=24), ChannelGroupQuantizer(bits=3, group=32, levels="normal")):
        _same(*_both(monkeypatch, quantizer, x[..., : 72 if quantizer.group == 24 else 64, :]))


@pytest.mark.interpreter
def test_channel_alloc_with_query_weights_packs_the_same_bytes_with_the_kernel(monkeypatch):
    quantizer = ChannelAllocQuantizer(mean_bits=3.5, query_weight=0.5)
    x = _keys((1, 2, 64, 128), torch.bfloat16, seed=1)
    weights = torch.rand(1, 2, 128) ** 3
    _same(*_both(monkeypatch, quantizer, x, channel_weights=weights))


@pytest.mark.interpreter
@pytest.mark.parametrize("settings", [
    dict(bits=3, scale_format="log8"), dict(bits=2), dict(bits=4, symmetric=False), dict(bits=3, group=32, symmetric=False),
])
@pytest.mark.parametrize("tokens", [64, 37])  # 37: the last tile of 16 tokens partly empty
def test_rotated_token_packs_the_same_bytes_with_the_kernel(monkeypatch, settings, tokens):
    quantizer = RotatedTokenQuantizer(**settings)
    if settings.get("scale_format") == "log8" and tokens % quantizer.scale_tokens:
        pytest.skip("log8 scales take whole runs of scale_tokens tokens")
    gen = torch.Generator().manual_seed(tokens)
    x = (torch.randn(2, 3, tokens, 128, generator=gen) * torch.linspace(0.1, 3.0, 128)).to(torch.bfloat16)
    by_torch, by_kernel = _both(monkeypatch, quantizer, x)
    _same(by_torch, by_kernel)
    codes = by_kernel["codes"]
    assert codes.shape == (2, 3, tokens, 128 * quantizer.bits // 8) and bool((codes != 0).any())


@pytest.mark.interpreter
@pytest.mark.parametrize("settings", [dict(bits=2, token_tiles=64), dict(bits=4, token_tiles=64, scale_format="log8"),
                                      dict(bits=2, token_tiles=64, symmetric=False)])
def test_values_in_tiles_take_their_codes_from_the_kernel_and_store_the_same_bytes(monkeypatch, settings):
    """Values in tiles of 64 tokens: the kernel's codes a byte each (``nearest_level_codes``), tiled and packed by torch;
    the token-by-token packing kernel is not called."""
    monkeypatch.setattr(pack, "nearest_levels", lambda *a, **k: pytest.fail("the token-by-token kernel was called"))
    called = []
    monkeypatch.setattr(pack, "nearest_level_codes", lambda *a, original=pack.nearest_level_codes: called.append(1) or original(*a))
    quantizer = RotatedTokenQuantizer(**settings)
    x = torch.randn(2, 3, 128, 128, generator=torch.Generator().manual_seed(settings["bits"])).to(torch.bfloat16)
    by_torch, by_kernel = _both(monkeypatch, quantizer, x)
    assert called == [1]
    _same(by_torch, by_kernel)
    assert torch.equal(quantizer.dequantize(by_kernel, torch.float32), quantizer.dequantize(by_torch, torch.float32))


@pytest.mark.interpreter
def test_the_uniform_levels_keep_the_torch_path(monkeypatch):
    """Uniform levels are coded and packed by torch whatever the switch (same bytes)."""
    for name in ("nearest_levels", "nearest_level_codes"):
        monkeypatch.setattr(pack, name, lambda *a, **k: pytest.fail("a kernel was called"))
    x = torch.randn(1, 2, 64, 64)
    for quantizer in (RotatedTokenQuantizer(bits=3, levels="uniform"), RotatedTokenQuantizer(bits=2, levels="uniform", token_tiles=64)):
        _same(*_both(monkeypatch, quantizer, x))


@pytest.mark.interpreter
def test_the_kernels_refuse_what_they_cannot_pack():
    x = torch.randn(2, 64, 128)
    zero = torch.zeros(2, 4, 128, dtype=torch.float16)
    bits = torch.full((2, 4, 128), 3)
    with pytest.raises(ValueError, match="groups of 16 tokens .* and 380 bits"):
        pack.affine_varwidth(x, zero, zero, bits, 380)
    with pytest.raises(ValueError, match="takes zero points, scales and widths"):
        pack.affine_varwidth(x, zero[:, :3], zero[:, :3], bits[:, :3], 384)
    with pytest.raises(ValueError, match="float16"):
        pack.affine_varwidth(x, zero.float(), zero, bits, 384)
    with pytest.raises(ValueError, match="outlier channels must be uint8"):
        pack.affine_varwidth(x, zero, zero, bits, 384, torch.zeros(2, 64, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="7 edges for 3 bits"):
        pack.nearest_levels(x, torch.ones(2, 64, 2), None, normal_edges(2), 3)
    with pytest.raises(ValueError, match="y float32"):
        pack.nearest_levels(x.half(), torch.ones(2, 64, 2), None, normal_edges(3), 3)


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("width, bits", [(256, 4), (256, 8), (128, 8)])
def test_the_packing_kernels_fit_an_h100s_shared_memory_at_wide_heads(width, bits):
    """Built for sm_90, each kernel's program takes at most the 227 KiB of shared memory an H100 or H200 gives a block:
    at head_dim 256 and 4 bits the whole one-hot operands took 256 KiB and the quantizers' kernels could not launch."""
    x = torch.randn(1, 8, 64, width)
    zero = torch.zeros(1, 8, 1, width, dtype=torch.float16)
    widths = torch.full((1, 8, 1, width), bits)
    limit = SHARED_LIMIT
    assert compile_for_gpu(pack.plan_affine_varwidth(x, zero, zero, widths, width * bits))["shared"] <= limit
    if bits < 8:
        built = compile_for_gpu(pack.plan_nearest_levels(x.float(), torch.ones(1, 8, 64, 2), None, normal_edges(bits),
                                                         bits))
        assert built["shared"] <= limit


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
def test_the_packing_kernels_compile_for_the_gpu():
    x = torch.randn(1, 8, 128, 128).to(torch.bfloat16)
    zero = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    bits = torch.full((1, 8, 2, 128), 3)
    compile_for_gpu(pack.plan_affine_varwidth(x, zero, zero, bits, 384, torch.zeros(1, 8, 128, 1, dtype=torch.uint8)))
    built = compile_for_gpu(pack.plan_nearest_levels(x.float(), torch.ones(1, 8, 128, 2), None, normal_edges(3), 3))
    assert built["cubin"] > 0
    raw = compile_for_gpu(pack.plan_nearest_levels(x.float(), torch.ones(1, 8, 128, 2), torch.zeros(1, 8, 128, 2),
                                                   normal_edges(2), 2, raw=True))  # a code a byte (values in tiles)
    assert raw["cubin"] > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares the compiled kernels with torch on a CUDA GPU")
def test_on_the_gpu_the_quantizers_pack_the_same_bytes_with_the_kernels(monkeypatch):
    """The frontier pipelines' quantizers at a real block's shape (8 KV heads, 4,096 tokens, head_dim 128)."""
    x = _keys((1, 8, 4096, 128), torch.bfloat16, seed=5).cuda()
    weights = torch.rand(1, 8, 128, device="cuda")
    _same(*_both(monkeypatch, ChannelAllocQuantizer(mean_bits=3.5, query_weight=0.5), x, channel_weights=weights))
    for quantizer in (RotatedTokenQuantizer(bits=3, scale_format="log8"), RotatedTokenQuantizer(bits=2, symmetric=False),
                      ChannelGroupQuantizer(bits=4, group=64, outliers=0), RotatedTokenQuantizer(bits=2, token_tiles=64),
                      RotatedTokenQuantizer(bits=4, token_tiles=64, scale_format="log8")):
        _same(*_both(monkeypatch, quantizer, x))
