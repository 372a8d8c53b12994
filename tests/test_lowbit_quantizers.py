"""The 2-4-bit quantizers ``channel-group`` (KVQuant-style keys: per channel over token groups, with
exact outliers) and ``rotated-token`` (QuaRot-style values: rotate, then per-token groups), and their
shared bit packing.

Each test states the property it checks; each could fail: a wrong step, a misplaced bit, an outlier not
restored, bytes that differ from the claim, a rotation that is not orthogonal or not reproducible, or a
rotation that does not help on the data it is meant for."""

from __future__ import annotations

import textwrap

import pytest
import torch

from kvweave.core import plugins
from kvweave.core.errors import ModelError
from kvweave.core.storage import tensor_bytes
from kvweave.plugins.quantizers import channel_group, rotated_token
from kvweave.plugins.quantizers._bitpack import normal_levels, pack, unpack
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer, rotation_matrix

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _relative(x: torch.Tensor, x_hat: torch.Tensor) -> float:
    return float((x.float() - x_hat.float()).norm() / x.float().norm())


def _keys_like(shape, seed=0):
    """Key-like data: channels of different widths, one channel with a large offset and one with a large
    spread (outlier channels), and a spike of +-40 in one random channel of a quarter of the tokens. Also
    returns the spikes alone (so ``x - spikes`` is the bulk)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator) * torch.linspace(0.5, 2.0, shape[-1])
    x[..., 3] = x[..., 3] * 4 + 15
    x[..., 17] *= 12
    spiked = torch.rand(shape[:-1], generator=generator) < 0.25
    channel = torch.randint(0, shape[-1], shape[:-1], generator=generator)
    sign = torch.randint(0, 2, shape[:-1], generator=generator) * 2 - 1
    spikes = torch.zeros(shape).scatter_(-1, channel.unsqueeze(-1), 40.0 * sign.unsqueeze(-1).float())
    spikes = spikes * spiked.unsqueeze(-1)
    return x + spikes, spikes


def _values_like(shape, seed=0):
    """Value-like data: Gaussian with one channel 20x wider (the case a rotation is for)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=generator)
    x[..., 5] *= 20
    return x


# --- bit packing ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 6, 7, 8])
def test_bit_packing_round_trips_densely(bits):
    # every code survives pack/unpack, and C codes take exactly C * bits / 8 bytes
    codes = torch.randint(0, 1 << bits, (3, 5, 64))
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 5, 64 * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_three_bit_codes_fill_three_bytes_per_eight_as_a_little_endian_stream():
    # code i sits at bits 3i..3i+2 of the byte string: 8 codes -> 3 bytes, the 24-bit word sum(c_i << 3i)
    codes = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 0]])
    word = sum(int(c) << (3 * i) for i, c in enumerate(codes[0]))
    assert pack(codes, 3).tolist() == [[word & 0xFF, (word >> 8) & 0xFF, word >> 16]]
    # 2-bit codes: four to a byte, code j at bits 2j (the kivi layout)
    assert pack(torch.tensor([[1, 2, 3, 0]]), 2).tolist() == [[1 | 2 << 2 | 3 << 4]]


def test_packing_refuses_a_width_that_does_not_fill_whole_bytes():
    with pytest.raises(ValueError, match="multiple of 8"):
        pack(torch.zeros(1, 12, dtype=torch.long), 3)


def test_normal_levels_are_the_lloyd_max_levels():
    # Max (1960): 2 bits +-0.4528, +-1.510; 3 bits outermost +-2.152
    assert normal_levels(2) == pytest.approx((-1.5104, -0.4528, 0.4528, 1.5104), abs=1e-4)
    assert normal_levels(3)[-1] == pytest.approx(2.152, abs=1e-3)


# --- channel-group ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("outliers", [0, 1, 2])
def test_channel_group_uniform_is_within_half_a_step_and_restores_outliers_exactly(bits, outliers):
    # non-outlier elements: within scale / 2 of their (channel, token group); outliers: float16-exact
    x, _ = _keys_like((2, 3, 64, 64))
    quantizer = ChannelGroupQuantizer(bits=bits, group=16, outliers=outliers)
    packed = quantizer.quantize(x)
    assert packed["codes"].shape == (2, 3, 64, 64 * bits // 8) and packed["scale"].shape == (2, 3, 4, 64)
    x_hat = quantizer.dequantize(packed, torch.float32)
    bound = packed["scale"].float().repeat_interleave(16, dim=-2) / 2
    exact = torch.zeros_like(x, dtype=torch.bool)
    if outliers:
        assert packed["outlier_index"].shape == (2, 3, 64, outliers)
        exact.scatter_(-1, packed["outlier_index"].long(), True)
        assert torch.equal(x_hat[exact], x[exact].half().float())
    within = (x - x_hat).abs() <= bound * (1 + 1e-6) + 1e-6
    assert bool(within[~exact].all())


def test_channel_group_outliers_are_the_spikes_and_keep_the_ranges_tight():
    # with one outlier per token, every token's spike of 40 is the stored outlier, so no channel's range
    # (scale) exceeds that of the bulk without spikes, while without outliers the spikes stretch them
    x, spikes = _keys_like((2, 3, 64, 64), seed=1)
    spiked = spikes.abs().amax(dim=-1) > 0
    with_outliers = ChannelGroupQuantizer(bits=2, group=32, outliers=1).quantize(x)
    picked = with_outliers["outlier_index"][..., 0].long()
    assert torch.equal(picked[spiked], spikes.abs().argmax(dim=-1)[spiked])
    bulk = ChannelGroupQuantizer(bits=2, group=32, outliers=0).quantize(x - spikes)["scale"].float()
    assert bool((with_outliers["scale"].float() <= bulk * (1 + 1e-3)).all())
    without = ChannelGroupQuantizer(bits=2, group=32, outliers=0).quantize(x)["scale"].float()
    assert float((without / bulk).amax()) > 3


def test_channel_group_normal_levels_take_the_nearest_level():
    # levels = "normal": each non-outlier element reconstructs to the level mean + std * z nearest to it
    x, _ = _keys_like((2, 2, 32, 32), seed=2)
    quantizer = ChannelGroupQuantizer(bits=2, group=32, outliers=1, levels="normal")
    packed = quantizer.quantize(x)
    assert set(packed) == {"codes", "mean", "std", "outlier_index", "outlier_value"}
    x_hat = quantizer.dequantize(packed, torch.float32)
    levels = packed["mean"].float().unsqueeze(-1) + packed["std"].float().unsqueeze(-1) * torch.tensor(normal_levels(2))
    # levels [..., 1, C, L]: the one token group (32 tokens) broadcasts over its tokens
    nearest = (x.unsqueeze(-1) - levels).abs().amin(dim=-1)
    exact = torch.zeros_like(x, dtype=torch.bool).scatter_(-1, packed["outlier_index"].long(), True)
    assert bool(((x - x_hat).abs() <= nearest + 1e-5)[~exact].all())
    assert torch.equal(x_hat[exact], x[exact].half().float())


def test_channel_group_normal_levels_beat_uniform_at_two_bits_on_gaussian_channels():
    # the property "normal" exists for: lower error than uniform steps at 2 bits on bell-shaped channels
    x = torch.randn(4, 3, 128, 64, generator=torch.Generator().manual_seed(3)) * torch.linspace(0.5, 3, 64)
    errors = {
        levels: _relative(x, (q := ChannelGroupQuantizer(bits=2, group=32, levels=levels)).dequantize(q.quantize(x), torch.float32))
        for levels in ("uniform", "normal")
    }
    assert errors["normal"] < 0.9 * errors["uniform"]


@pytest.mark.parametrize(
    "bits, outliers, levels", [(3, 1, "uniform"), (4, 0, "uniform"), (4, 1, "uniform"), (3, 1, "normal"), (4, 1, "normal")]
)
def test_channel_group_beats_per_token_int4_on_keys_with_outlier_channels(bits, outliers, levels):
    # per-channel ranges do not let an outlier channel coarsen the others, unlike one scale per 32
    # channels of a token: lower error at 3-4 bits than int4-group (margins ~2x or more on this data;
    # normal levels without outliers fold the spikes into the std, so they are not claimed)
    x, _ = _keys_like((2, 3, 64, 64), seed=4)
    int4 = Int4GroupQuantizer(group=32)
    ours = ChannelGroupQuantizer(bits=bits, group=32, outliers=outliers, levels=levels)
    assert _relative(x, ours.dequantize(ours.quantize(x), torch.float32)) < _relative(
        x, int4.dequantize(int4.quantize(x), torch.float32)
    )


def test_channel_group_keeps_leading_dims_and_groups_along_dim_minus_2():
    # [S, B, H, n, C] as the engine hands it: fields keep the leading dims, one stats row per 8 tokens
    x, _ = _keys_like((2, 1, 3, 24, 32), seed=5)
    quantizer = ChannelGroupQuantizer(bits=3, group=8, outliers=2)
    packed = quantizer.quantize(x)
    assert packed["codes"].shape == (2, 1, 3, 24, 12) and packed["zero"].shape == (2, 1, 3, 3, 32)
    assert packed["outlier_value"].shape == (2, 1, 3, 24, 2) and packed["outlier_value"].dtype == torch.float16
    assert quantizer.dequantize(packed, torch.float32).shape == x.shape
    assert quantizer.tokens_per_group() == 8


# --- rotated-token ----------------------------------------------------------------------------------


@pytest.mark.parametrize("rotation, width", [("hadamard", 64), ("hadamard", 128), ("random", 64), ("random", 48)])
def test_rotations_are_orthogonal_and_reproducible(rotation, width):
    # Q Q^T = I, and the same (rotation, seed, C) always gives the same Q (it is never stored)
    q = rotation_matrix(rotation, 7, width)
    assert torch.allclose(q @ q.T, torch.eye(width), atol=1e-5)
    rotation_matrix.cache_clear()
    assert torch.equal(rotation_matrix(rotation, 7, width), q)
    assert not torch.equal(rotation_matrix(rotation, 8, width), q)


def test_hadamard_rotation_is_a_signed_normalized_hadamard_matrix():
    # entries +-1/sqrt(C); dividing out the column signs leaves the Sylvester matrix (first row all +)
    q = rotation_matrix("hadamard", 0, 64)
    assert torch.allclose(q.abs(), torch.full((64, 64), 1 / 8))
    signs = torch.sign(q[0])
    unsigned = q * signs * 8
    assert torch.equal(unsigned[0], torch.ones(64)) and torch.allclose(unsigned @ unsigned.T, 64 * torch.eye(64))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("symmetric", [True, False])
def test_rotated_token_uniform_is_within_half_a_step_in_the_rotated_space(bits, symmetric):
    # every rotated element within scale / 2 of its level, so ||x - x_hat|| <= ||scale / 2|| per vector
    x = _values_like((2, 3, 40, 64))
    quantizer = RotatedTokenQuantizer(bits=bits, group=32, symmetric=symmetric, levels="uniform")
    packed = quantizer.quantize(x)
    assert set(packed) == ({"codes", "scale"} if symmetric else {"codes", "scale", "zero"})
    x_hat = quantizer.dequantize(packed, torch.float32)
    q = rotation_matrix("hadamard", 0, 64)
    step = packed["scale"].float().repeat_interleave(32, dim=-1)
    tolerance = 1e-5 * float(x.abs().max())
    assert bool(((x @ q.T - x_hat @ q.T).abs() <= step / 2 * (1 + 1e-6) + tolerance).all())
    per_vector = (step / 2).square().sum(dim=-1).sqrt()
    assert bool(((x - x_hat).norm(dim=-1) <= per_vector + tolerance).all())


def test_rotated_token_normal_levels_take_the_nearest_level_in_the_rotated_space():
    x = _values_like((3, 20, 64), seed=1)
    quantizer = RotatedTokenQuantizer(bits=3, group=32)
    packed = quantizer.quantize(x)
    q = rotation_matrix("hadamard", 0, 64)
    y, y_hat = (x @ q.T).reshape(3, 20, 2, 32), (quantizer.dequantize(packed, torch.float32) @ q.T).reshape(3, 20, 2, 32)
    levels = packed["scale"].float().unsqueeze(-1) * torch.tensor(normal_levels(3))  # [..., 2, L]
    nearest = (y.unsqueeze(-1) - levels.unsqueeze(-2)).abs().amin(dim=-1)
    assert bool(((y - y_hat).abs() <= nearest + 1e-4).all())


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("levels", ["normal", "uniform"])
@pytest.mark.parametrize("rotation", ["hadamard", "random"])
def test_rotation_lowers_the_error_of_per_token_groups_with_an_outlier_channel(bits, levels, rotation):
    # the property the rotation is for: one 20x channel no longer sets every other channel's step
    x = _values_like((2, 3, 64, 64), seed=2)
    rotated = RotatedTokenQuantizer(bits=bits, levels=levels, rotation=rotation)
    plain = RotatedTokenQuantizer(bits=bits, levels=levels, rotation="none")
    rotated_error = _relative(x, rotated.dequantize(rotated.quantize(x), torch.float32))
    plain_error = _relative(x, plain.dequantize(plain.quantize(x), torch.float32))
    assert rotated_error < 0.6 * plain_error


def test_rotated_token_metadata_stays_under_half_a_bit_per_element_at_the_defaults():
    quantizer = RotatedTokenQuantizer()
    assert (quantizer.bytes_per_vector(64, torch.float16) - 64 * quantizer.bits / 8) * 8 / 64 < 0.5


# --- both -------------------------------------------------------------------------------------------

QUANTIZERS = [
    ChannelGroupQuantizer(),
    ChannelGroupQuantizer(bits=3, group=16, outliers=0),
    ChannelGroupQuantizer(bits=4, group=8, outliers=3, levels="normal"),
    RotatedTokenQuantizer(),
    RotatedTokenQuantizer(bits=3, group=16, symmetric=False, rotation="random"),
    RotatedTokenQuantizer(bits=4, levels="uniform"),
]


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packed_bytes_are_what_bytes_per_vector_claims(quantizer, dtype):
    # the sum of the packed fields' nbytes is bytes_per_vector * vectors, whatever the input dtype
    x, _ = _keys_like((2, 3, 64, 64), seed=6)
    packed = quantizer.quantize(x.to(dtype))
    assert tensor_bytes(packed.values()) == quantizer.bytes_per_vector(64, dtype) * x[..., 0].numel()
    assert all(t.shape[:-2] == x.shape[:-2] for t in packed.values())


@pytest.mark.parametrize("quantizer", QUANTIZERS, ids=repr)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_in_any_float_dtype_and_device(quantizer, device, dtype):
    # dequantize gives [..., C] in the dtype asked for, on the input's device, close to the input
    x, _ = _keys_like((2, 32, 64), seed=7)
    x = x.to(device=device, dtype=dtype)
    packed = quantizer.quantize(x)
    for out in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        x_hat = quantizer.dequantize(packed, out)
        assert x_hat.dtype == out and x_hat.device == x.device and x_hat.shape == x.shape
    assert _relative(x, quantizer.dequantize(packed, torch.float32)) < 0.6


def test_constant_and_zero_inputs_survive():
    # a group with no spread has scale 0: it must decode to its value, not to NaN (zero vectors for both;
    # for channel-group also channels constant over their token group, with or without outliers)
    constant = torch.randn(1, 1, 64).half().float().expand(2, 32, 64)
    for quantizer in QUANTIZERS:
        inputs = [torch.zeros(2, 32, 64)] + ([constant] if isinstance(quantizer, ChannelGroupQuantizer) else [])
        for x in inputs:
            x_hat = quantizer.dequantize(quantizer.quantize(x), torch.float32)
            assert torch.allclose(x_hat, x, atol=1e-5), quantizer


def test_bad_widths_are_refused_naming_the_place_and_what_is_accepted():
    with pytest.raises(ModelError, match="slot K.*width 12.*multiple of 8"):
        ChannelGroupQuantizer(bits=3).check_width(12, "slot K")
    with pytest.raises(ModelError, match="slot K.*uint8.*outliers = 0"):
        ChannelGroupQuantizer(bits=2, outliers=1).check_width(512, "slot K")
    ChannelGroupQuantizer(bits=2, outliers=0).check_width(512, "slot K")
    with pytest.raises(ModelError, match="slot V.*power-of-two width, got 48.*'random'"):
        RotatedTokenQuantizer(group=16).check_width(48, "slot V")
    RotatedTokenQuantizer(group=16, rotation="random").check_width(48, "slot V")
    with pytest.raises(ModelError, match="slot V.*group=24"):
        RotatedTokenQuantizer(group=24).check_width(64, "slot V")
    with pytest.raises(ValueError, match="not a multiple of group=32"):
        ChannelGroupQuantizer(group=32).quantize(torch.zeros(40, 64))


@pytest.mark.parametrize(
    "factory, kwargs",
    [
        (ChannelGroupQuantizer, {"bits": 5}), (ChannelGroupQuantizer, {"outliers": -1}),
        (ChannelGroupQuantizer, {"levels": "lloyd"}), (ChannelGroupQuantizer, {"group": 0}),
        (RotatedTokenQuantizer, {"bits": 1}), (RotatedTokenQuantizer, {"rotation": "dct"}),
        (RotatedTokenQuantizer, {"symmetric": 1}), (RotatedTokenQuantizer, {"seed": -1}),
    ],
)
def test_invalid_parameters_are_refused(factory, kwargs):
    with pytest.raises((TypeError, ValueError), match=next(iter(kwargs))):
        factory(**kwargs)


# --- through the registry and the cache -------------------------------------------------------------

REGISTRY = textwrap.dedent("""
    [pipelines.t-lowbit]
    extends = "int4-prerope"
    recent_window = 32
    block_tokens = 32

    [pipelines.t-lowbit.keys.quantizer]
    use = "channel-group"
    bits = 3
    group = 16
    outliers = 1

    [pipelines.t-lowbit.values.quantizer]
    use = "rotated-token"
    bits = 2
""")


@pytest.fixture
def registered():
    """The two quantizers in the plugin catalog (registered here unless the entry points already do)."""
    added = []
    known = plugins.catalog().components["quantizers"]
    for module, name in ((channel_group, "channel-group"), (rotated_token, "rotated-token")):
        if name not in known:
            plugins.register_plugin(module, f"test-{name}-quantizer")
            added.append(f"test-{name}-quantizer")
    try:
        yield
    finally:
        for plugin in added:
            plugins.unregister_plugin(plugin)


def test_a_pipeline_stores_pre_rope_keys_and_rotated_values_at_the_claimed_bytes(registered, tmp_path):
    # both register, resolve per kind, generate on a tiny model, and the cache's coefficient bytes are
    # bytes_per_vector of keys plus values for every compressed token, head and layer
    from conftest import tiny_llama, write_registry

    from kvweave.core.registry import load_pipeline
    from kvweave.engine import build_cache, cache_kwargs

    assert plugins.catalog().get("quantizers", "channel-group").factory is ChannelGroupQuantizer
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(0))
    cache = build_cache(load_pipeline("t-lowbit", write_registry(tmp_path, "lowbit", REGISTRY)), model)
    out = model.generate(input_ids=ids, max_new_tokens=4, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    assert out.shape == (1, 154)
    compressed = sum(window.compressed_tokens for window in cache.engine.windows)
    assert compressed > 0
    per_token = ChannelGroupQuantizer(bits=3, group=16).bytes_per_vector(16, torch.float32) + RotatedTokenQuantizer(
        bits=2
    ).bytes_per_vector(16, torch.float32)
    assert cache.memory_breakdown()["coefficients"] == compressed * 2 * per_token  # 2 KV heads
