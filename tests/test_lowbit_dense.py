"""The ``lowbit`` kernel's ``dense`` variant (keys stored after RoPE in 2- or 4-bit channel-group codes, 2- or 4-bit
values, the codes read as 32-bit words): against the torch twin under Triton's interpreter on every whole-byte storage
of tests/test_lowbit_kernel.py (keys stored before RoPE read as if stored after it, the twin alike), and what it
refuses. On a GPU machine tests/test_lowbit_gpu.py runs it as compiled."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.engine import build_cache, importance
from kvweave.kernels.lowbit_decode import dense_refusal, lowbit_decode, plan_launch, resolve_variant, torch_lowbit_decode

from conftest import CharTokenizer, tiny_llama
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


def stored_view(model, registry, name, hidden=64):
    """Layer 1's packed storage of pipeline ``name`` after a 230-token prompt (a tiny Llama of ``hidden`` channels),
    as the kernel reads it, and the batch rows."""
    net = model if hidden == 64 else tiny_llama(layers=2, hidden=hidden)
    cache = build_cache(registry.resolve(name), net, tokenizer=CharTokenizer())
    rows = 1 if importance.needs_importance(cache) else 2  # kvzip scores whole rows one at a time
    ids = torch.randint(1, 128, (rows, 230), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        importance.prefill(net, cache, ids)
    return cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu")), rows


def _post_rope_view(model, registry, name, hidden=64):
    view, rows = stored_view(model, registry, name, hidden)
    return attrs.evolve(view, inv_freq=None), rows


@pytest.mark.interpreter
@pytest.mark.parametrize("name, hidden", [
    ("prerope-k4v2-lowbit", 64),  # 4-bit keys with an outlier, 2-bit normal levels
    ("t-lowbit-post", 64),  # stored after RoPE by the pipeline itself
    ("t-lowbit-post", 512),  # 4-bit keys at head_dim 128: read by code places (KPLANES)
    ("t-lowbit-k2v4", 512),  # 2-bit keys with two outliers at head_dim 128, 4-bit uniform values
    ("t-lowbit-v4", 64),  # 4-bit uniform values
    ("t-lowbit-k4log8", 64),  # one-byte log8 value scales
    ("t-lowbit-kvzip-cg", 64),  # slots at their cache indices, fillers never attended
    ("t-lowbit-sinks-cg", 64),  # slots hidden: their tokens restored and attended with the exact window
])
def test_the_dense_kernel_matches_its_twin(model, registry, name, hidden):
    view, rows = _post_rope_view(model, registry, name, hidden)
    assert dense_refusal(view) is None, dense_refusal(view)
    dim = view.exact_k.shape[-1]
    q = torch.randn(rows, 4, dim, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0][:rows], dtype=torch.int32)
    blocks = [block for block in (64, 32, 16) if dense_refusal(view, block) is None]  # 64 only at head_dim 128
    assert blocks == ([64, 32, 16] if dim >= 128 else [32, 16])
    for first in (start, None):
        twin = torch_lowbit_decode(view, q, first, dim ** -0.5)
        for block in (blocks[0], blocks[-1]):  # the longest and the shortest step (the interpreter's time)
            out = lowbit_decode(view, q, first, dim ** -0.5, block=block, variant="dense")
            assert torch.allclose(out, twin, atol=1e-5), (name, block, (out - twin).abs().max())
    # a wrong code order, scale or mask moves the output by its own size: the twin is not matched by chance
    assert float(twin.abs().max()) > 0.05


@pytest.mark.interpreter
@pytest.mark.parametrize("name, hidden", [
    ("t-lowbit-post", 512),  # head_dim 128: 4-bit keys by code places, two value groups sharing a tile
    ("t-lowbit-k2v4", 512),  # 2-bit keys with outliers, 4-bit uniform values, two value groups
    ("t-lowbit-kvzip-cg", 64),  # one value group, slots at their cache indices
])
def test_query_heads_that_fill_half_the_tile_take_two_columns_each_and_match_the_twin(model, registry, name, hidden):
    """Where the tile's rows are twice a KV head's query heads (rounded up to a power of two: 3 or 4 heads in 8 rows),
    each head takes two columns (``PAD`` = 2): the softmax runs on the real rows and one tile of probabilities serves
    two value groups, each meeting its own half; other groups keep one column a head. Every grouping decodes as the
    twin does, so a group reading the other's half (its scales differ) or a row written to the wrong place fails."""
    from kvweave.kernels.lowbit_dense import query_pad

    view, rows = _post_rope_view(model, registry, name, hidden)
    heads, dim = view.exact_k.shape[1], view.exact_k.shape[-1]
    start = torch.tensor([40, 0][:rows], dtype=torch.int32)
    for group, pad in ((4, 2), (3, 2), (2, 1), (8, 1)):
        assert query_pad(group, 8) == pad
        q = torch.randn(rows, group * heads, dim, generator=torch.Generator().manual_seed(group))
        assert plan_launch(view, q, start, dim ** -0.5, variant="dense").constants["PAD"] == pad
        twin = torch_lowbit_decode(view, q, start, dim ** -0.5)
        out = lowbit_decode(view, q, start, dim ** -0.5, variant="dense")
        assert torch.allclose(out, twin, atol=1e-5), (name, group, (out - twin).abs().max())
        assert float(twin.abs().max()) > 0.05


def test_the_tiled_values_operands_are_fenced_only_where_the_products_are_ampere_ones(monkeypatch):
    """``ASM`` = 2 (the tiled values' operands behind an opaque instruction) where Triton builds Ampere products: a
    Triton before 3.8 whatever the tensor's device, a GPU before Hopper; a CPU tensor with a newer Triton (the sm_90
    build of benchmarks/kernel_sass.py) keeps warpgroup products and plain operands (fenced, they cost instructions)."""
    import triton

    from kvweave.kernels import lowbit_dense

    cpu = torch.device("cpu")
    for version, ampere in (("3.6.0", True), ("3.7.1", True), ("3.8.0", False), ("3.10.0", False)):
        monkeypatch.setattr(triton, "__version__", version)
        assert lowbit_dense.ampere_products(cpu) is ampere, version
    monkeypatch.setattr(triton, "__version__", "3.9.0")
    monkeypatch.setattr(lowbit_dense, "capability", lambda device: (8, 0))
    assert lowbit_dense.ampere_products(torch.device("cuda", 0))
    monkeypatch.setattr(lowbit_dense, "capability", lambda device: (9, 0))
    assert not lowbit_dense.ampere_products(torch.device("cuda", 0))


def test_the_dense_kernel_refuses_what_it_cannot_read(model, registry):
    """Keys before RoPE at head_dim 64, channel-alloc widths, 3-bit codes, steps that do not divide the token group,
    the TF32 key products and 8 warps a program are refused, each saying why; the wide kernel reads them all. Keys
    before RoPE at head_dim 128 are read (rotated in registers, tests/test_dense_rope.py)."""
    q = torch.randn(2, 4, 64)
    cache = build_cache(registry.resolve("prerope-k4v2-lowbit"), model)
    with torch.no_grad():
        importance.prefill(model, cache, torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2)))
    pre = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    with pytest.raises(ValueError, match="before RoPE at head_dims of at least 128"):  # tests/test_dense_rope.py at 128
        resolve_variant(pre, "dense")
    post = attrs.evolve(pre, inv_freq=None)
    assert resolve_variant(post, "dense") == ("dense", 32)  # head_dim 64: 32-token steps
    # the default launch takes it wherever it reads the storage; steps asked for keep the other kernels' choice
    assert resolve_variant(post, "auto") == ("dense", 32) and resolve_variant(pre, "auto") == ("wide", 32)
    assert resolve_variant(post, "auto", 32) == ("wide", 32)
    for block, match in ((48, "power of two"), (128, "divides the keys' token group"), (8, "at least 16"),
                         (64, "at head_dim 64 its steps must be at most 32")):
        with pytest.raises(ValueError, match=match):
            resolve_variant(post, "dense", block)
    with pytest.raises(ValueError, match="not 'ktf32'"):
        plan_launch(post, q, None, 0.125, variant="dense", lowp=True, tricks="ktf32")
    with pytest.raises(ValueError, match="runs with 2 or 4 warps a program, got 8"):  # wrong attention at 8 on a GPU
        plan_launch(post, q, None, 0.125, variant="dense", num_warps=8)
    assert plan_launch(post, q, None, 0.125, variant="dense", num_warps=2).constants["num_warps"] == 2
    for name, match in (("t-lowbit-alloc-post", "channel-group keys"), ("t-lowbit-k3v3", "channel-group keys")):
        view, _ = _post_rope_view(model, registry, name)
        with pytest.raises(ValueError, match=match):
            lowbit_decode(view, q[:view.exact_k.shape[0] // 2 or 1], None, 0.125, variant="dense")
        assert plan_launch(view, q[:1], None, 0.125, variant="wide").kernel is not None
    three_bit_values = attrs.evolve(post, v_bits=3)
    with pytest.raises(ValueError, match="2- or 4-bit values"):
        resolve_variant(three_bit_values, "dense")


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["kzd-k4v2-f48", "kzd-k4v4-f77"])
def test_the_dense_sweep_pipelines_decode_through_the_dense_kernel(model, name):
    """benchmarks/dense_sweep.toml's pipelines are the ones whose needles docs/eval/h200-2026-12-02-dense measured as
    read by the dense kernel: their storage is what the default launch gives to it, and it decodes as the twin."""
    from pathlib import Path

    from kvweave.core.registry import load_registry

    registry = load_registry(Path(__file__).resolve().parents[1] / "benchmarks" / "dense_sweep.toml")
    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(4)))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.inv_freq is None and view.positions is not None and view.restored_k is not None
    assert resolve_variant(view, "auto") == ("dense", 32)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(5))
    twin = torch_lowbit_decode(view, q, None, 0.125)
    assert torch.allclose(lowbit_decode(view, q, None, 0.125), twin, atol=1e-5)
    levels16 = plan_launch(view, q, None, 0.125).args[10]  # the bfloat16 level table: the view's own, no copy a call
    assert levels16 is view.v_levels16 and torch.equal(levels16, view.v_levels.to(torch.bfloat16))


@pytest.mark.interpreter
def test_head_dim_256_reads_four_value_groups_and_is_taken_by_default(registry, monkeypatch):
    """At head_dim 256 (Gemma-3's) the dense kernel reads four value groups as the twin does, and the default launch
    takes it there (tests/test_lowbit_gpu.py checks that build on a GPU); a head_dim left out of the checked ones goes to
    the wide kernel."""
    view, _ = _post_rope_view(tiny_llama(layers=2, hidden=1024), registry, "prerope-k4v2-lowbit")
    assert view.exact_k.shape[-1] == 256 and view.exact_k.shape[-1] // view.v_group == 4
    q = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(6))
    start = torch.tensor([40, 0], dtype=torch.int32)
    twin = torch_lowbit_decode(view, q, start, 0.0625)
    assert torch.allclose(lowbit_decode(view, q, start, 0.0625, variant="dense"), twin, atol=1e-5)
    assert resolve_variant(view, "auto") == ("dense", 64)
    from kvweave.kernels import lowbit_dense

    monkeypatch.setattr(lowbit_dense, "GPU_CHECKED_DIMS", (64, 128))
    assert resolve_variant(view, "auto") == ("wide", 32)


@pytest.mark.interpreter
def test_keys_read_by_code_places_give_the_channel_order_products(registry, monkeypatch):
    """4-bit keys of 16 or more words a token are read as eight products, one per code place of a word, their scales
    and zero points loaded a step ahead as int32 words or where they are used; the same logits as the products in
    channel order, for keys with outliers and a first visible position; 2-bit keys keep the channel-order product."""
    from kvweave.kernels import lowbit_dense

    view, rows = _post_rope_view(tiny_llama(layers=2, hidden=512), registry, "prerope-k4v2-lowbit")
    assert view.exact_k.shape[-1] == 128 and view.k_bits == 4 and view.k_out_index is not None
    q = torch.randn(rows, 4, 128, generator=torch.Generator().manual_seed(7))
    start = torch.tensor([40, 0][:rows], dtype=torch.int32)
    launch = plan_launch(view, q, start, 0.088, variant="dense")
    assert launch.constants["KPLANES"] and launch.constants["KPF"]  # float16 scales: loaded a step ahead as words
    planes = lowbit_decode(view, q, start, 0.088, variant="dense")
    monkeypatch.setattr(lowbit_dense, "DENSE_PLANE_PREFETCH", False)
    assert not plan_launch(view, q, start, 0.088, variant="dense").constants["KPF"]
    in_place = lowbit_decode(view, q, start, 0.088, variant="dense")
    assert torch.allclose(planes, in_place, atol=1e-5), (planes - in_place).abs().max()
    monkeypatch.setattr(lowbit_dense, "DENSE_KEY_PLANES", False)
    assert not plan_launch(view, q, start, 0.088, variant="dense").constants["KPLANES"]
    ordered = lowbit_decode(view, q, start, 0.088, variant="dense")
    assert torch.allclose(planes, ordered, atol=1e-5), (planes - ordered).abs().max()
    assert torch.allclose(planes, torch_lowbit_decode(view, q, start, 0.088), atol=1e-5)
    monkeypatch.setattr(lowbit_dense, "DENSE_KEY_PLANES", True)
    narrow, _ = _post_rope_view(tiny_llama(layers=2, hidden=512), registry, "t-lowbit-k2v4")
    assert narrow.k_bits == 2 and not plan_launch(narrow, q, None, 0.088, variant="dense").constants["KPLANES"]


@pytest.mark.interpreter
def test_hidden_slots_in_any_step_and_split_are_left_out(model, registry):
    """The dense kernel checks the hidden-slot list only in the steps between a program's first and last hidden slot:
    slots listed anywhere (two in one step, one in another split's step, one at a step's first slot, padding -1) are
    left out as the twin leaves them out, and a list of none hides nothing."""
    view, rows = _post_rope_view(model, registry, "t-lowbit-sinks-cg")
    q = torch.randn(rows, 4, 64, generator=torch.Generator().manual_seed(9))
    heads = view.exact_k.shape[1]
    assert view.tokens >= 192
    for listed in ([-1, 3, 130, 131], [191, -1, -1, -1], [96, -1, -1, -1], [-1, -1, -1, -1]):
        hidden = torch.tensor(listed, dtype=torch.int32).expand(rows * heads, 4).contiguous()
        hid = attrs.evolve(view, hidden_slots=hidden, hidden_below=None)  # a list, not the sinks' prefix
        twin = torch_lowbit_decode(hid, q, None, 0.125)
        for block in (32, 16):
            out = lowbit_decode(hid, q, None, 0.125, block=block, variant="dense", programs=4 * rows * heads)
            assert torch.allclose(out, twin, atol=1e-5), (listed, block, (out - twin).abs().max())
        if listed[1] == 3:  # hiding the slots moves the output: the check is not vacuous
            assert not torch.allclose(twin, torch_lowbit_decode(view, q, None, 0.125), atol=1e-4)


def _prmt(low: int, high: int, selector: int) -> int:
    """PTX ``prmt.b32 d, low, high, selector`` (default mode): byte j of d is byte ``selector`` nibble j (low 3 bits) of
    the 8 bytes ``high:low``; a nibble's bit 3 would replicate a sign, which the selectors here must not set."""
    pool = low | (high << 32)
    out = 0
    for j in range(4):
        nibble = (selector >> (4 * j)) & 0xF
        assert nibble < 8, "a selector nibble with its sign bit set"
        out |= ((pool >> (8 * (nibble & 7))) & 0xFF) << (8 * j)
    return out


def _bf16(bits: int) -> float:
    return float(torch.tensor([bits], dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float())


def test_the_gpu_builds_operand_arithmetic_gives_each_codes_level():
    """The GPU build's 2-bit value table (a byte permute of the four levels' bfloat16 bits, selectors made from four
    codes at once) and its 4-bit uniform operands (the code in 1.0's bits plus an offset), replayed on the CPU with the
    constants the kernel is built from: every code of every byte position gives its own level, exactly. (The
    interpreter runs the kernel without this arithmetic; tests/test_lowbit_gpu.py runs it compiled.)"""
    from kvweave.kernels.lowbit_dense import (LEVEL_SELECT_ADD, LEVEL_SELECT_MUL, UNIFORM4_BASE, UNIFORM4_OFFSET,
                                              level_word)

    levels = [-1.51, -0.4528, 0.4528, 1.51]
    word = level_word(levels) & (2**64 - 1)
    low, high = word & 0xFFFFFFFF, word >> 32
    expect = [float(torch.tensor(x).to(torch.bfloat16).float()) for x in levels]
    gen = torch.Generator().manual_seed(11)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31 - 1, (64,), generator=gen, dtype=torch.int64)]
    words += [0, 0xFFFFFFFF, 0x1B1B1B1B, 0xE4E4E4E4]  # every code in every place
    for w in words:
        for k in range(4):  # codes k, k + 4, k + 8, k + 12 a byte each, made selectors together
            z = (((w >> (2 * k)) & 0x03030303) * LEVEL_SELECT_MUL + LEVEL_SELECT_ADD * 0x01010101) & 0xFFFFFFFF
            for half in range(2):  # bytes 0-1 of the selectors, then 2-3
                pair = _prmt(low, high, (z >> (16 * half)) & 0xFFFF)
                for h in range(2):
                    code = (w >> (2 * (k + 4 * (2 * half + h)))) & 3
                    assert _bf16((pair >> (16 * h)) & 0xFFFF) == expect[code], (hex(w), k, half, h)
    offset = _bf16(UNIFORM4_OFFSET)
    for w in words:
        for k, shift in enumerate((-3, 1, 5, 9)):  # code k to bit 3 of the low half, k + 4 of the high half
            moved = (w << -shift if shift < 0 else w >> shift) & 0xFFFFFFFF
            bits = (moved & (0x78 * 0x10001)) | (UNIFORM4_BASE * 0x10001)
            for h, code in enumerate(((w >> (4 * k)) & 15, (w >> (4 * (k + 4))) & 15)):
                total = torch.tensor(_bf16((bits >> (16 * h)) & 0xFFFF) + offset).to(torch.bfloat16).float()
                assert float(total) == (code - 7.5) / 16, (hex(w), k, h)


def _lop3(a: int, b: int, c: int, lut: int) -> int:
    """PTX ``lop3.b32``: each bit of the result is bit ``(a << 2) | (b << 1) | c`` of ``lut``, per bit position."""
    out = 0
    for bit in range(32):
        index = (((a >> bit) & 1) << 2) | (((b >> bit) & 1) << 1) | ((c >> bit) & 1)
        out |= ((lut >> index) & 1) << bit
    return out


def test_the_gpu_builds_key_operands_by_code_place_give_128_plus_each_code():
    """The inline assembly that makes a code place's operand register from two neighbouring words of a token (one byte
    permute, one shift, one three-input logic operation), replayed on the CPU from the kernel's own text: the low half
    is bfloat16 ``128 + code k`` of the first word, the high half of the second, for every code place and code."""
    import re

    from kvweave.kernels import lowbit_step_triton

    gen = torch.Generator().manual_seed(12)
    words = [int(w) & 0xFFFFFFFF for w in torch.randint(-2**31, 2**31 - 1, (48,), generator=gen, dtype=torch.int64)]
    words += [0, 0xFFFFFFFF, 0x76543210, 0xFEDCBA98]  # every code in every place
    for k in range(8):
        text = lowbit_step_triton._plane_text(k)
        sel, shift, mask, bits, lut = (int(x, 0) for x in re.search(
            r"prmt\.b32 t, \$1, \$2, (\w+); shr\.b32 t, t, (\w+); lop3\.b32 \$0, t, (\w+), (\w+), (\w+);", text).groups())
        for first, second in zip(words, words[::-1]):
            out = _lop3(_prmt(first, second, sel) >> shift, mask, bits, lut)
            for half, word in enumerate((first, second)):
                assert _bf16((out >> (16 * half)) & 0xFFFF) == 128 + ((word >> (4 * k)) & 15), (k, hex(first), hex(second))


@pytest.mark.interpreter
@pytest.mark.parametrize("name, variant", [("t-lowbit-sinks-cg", "dense"), ("t-lowbit-sinks-kvzip", "wide")])
def test_the_sinks_hidden_slots_become_the_packed_passs_first_position(model, registry, name, variant):
    """The sinks router's restored tokens are the first positions of each row, so the view says so (``hidden_below``)
    and the packed pass starts there instead of checking a list (no ``HID``): the same output as with the list and as
    the twin, with and without a first visible position of the row's own (the dense kernel, and the wide one on
    channel-alloc keys). Hidden slots that are not such a prefix keep the list."""
    from kvweave.plugins.kernels.lowbit import hidden_prefix

    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    rows = 1 if importance.needs_importance(cache) else 2
    ids = torch.randint(1, 128, (rows, 230), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        importance.prefill(model, cache, ids)
    view = attrs.evolve(cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu")), inv_freq=None)
    assert view.hidden_slots is not None and view.hidden_below is not None
    sinks = int((view.restored_pos[0, 0] >= 0).sum())
    assert sinks >= 1 and view.hidden_below.tolist() == [int(view.restored_pos[r].max()) + 1 for r in range(rows)]
    q = torch.randn(rows, 4, 64, generator=torch.Generator().manual_seed(12))
    listed = attrs.evolve(view, hidden_below=None)
    for start in (None, torch.tensor([2, 40][:rows], dtype=torch.int32)):
        assert plan_launch(view, q, start, 0.125, variant=variant).constants["HID"] == 0
        assert plan_launch(listed, q, start, 0.125, variant=variant).constants["HID"] > 0
        twin = torch_lowbit_decode(view, q, start, 0.125)
        for packed in (view, listed):
            out = lowbit_decode(packed, q, start, 0.125, variant=variant)
            assert torch.allclose(out, twin, atol=1e-5), (name, start, (out - twin).abs().max())
    # a hidden slot past a visible one is no prefix: the list stays
    later = attrs.evolve(view, restored_pos=view.restored_pos.clone())
    later.restored_pos[..., 0] = int(view.hidden_below.max()) + 3
    assert hidden_prefix(later, torch.device("cpu")) is None


@pytest.mark.interpreter
def test_a_synthetic_fill_keeps_the_sinks_as_real_scoring_does(model, registry):
    """The benchmarks fill a KVzip cache with random scores (``kvweave.engine.synthetic``): its sinks are kept as KVzip's
    scorer keeps them, so the sinks router restores positions 0-3 in every head and the packed pass starts past them
    (before, random scores evicted some of them and the restored tokens were a list of other positions)."""
    from kvweave.engine.synthetic import fill_cache

    cache = build_cache(registry.resolve("t-lowbit-sinks-kvzip"), model, tokenizer=CharTokenizer())
    fill_cache(cache, 2, 300, seed=5)
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    sinks = cache.engine.evictor.sinks
    assert view.positions is not None and view.tokens < 300  # tokens were dropped
    assert view.hidden_below is not None and view.hidden_below.tolist() == [sinks, sinks]
    assert sorted(set(view.restored_pos.flatten().tolist())) == list(range(sinks))


@pytest.mark.interpreter
@pytest.mark.parametrize("flat_name, tiled_name", [("kzd-k4v2-f48-d128", "kzd-k4v2t-f48-d128"),  # 2-bit normal levels
                                                   ("kzd-k4v4-f77-d128", "kzd-k4v4t-f77-d128")])  # 4-bit uniform ones
def test_values_in_tiles_decode_as_the_token_major_ones_through_the_dense_kernel(flat_name, tiled_name):
    """``kzd-k4v2t-f48-d128`` (benchmarks/dense_sweep.toml) stores ``kzd-k4v2-f48-d128``'s value codes in tiles of 64
    tokens (``kzd-k4v4t-f77-d128`` the 4-bit ones of ``kzd-k4v4-f77-d128``): the same stored bytes in another order,
    read by the dense kernel (taken by default) as the twin reads them and as the kernel reads the token-major codes;
    the kernels that read values token by token refuse them by name."""
    from pathlib import Path

    from kvweave.core.registry import load_registry

    registry = load_registry(Path(__file__).resolve().parents[1] / "benchmarks" / "dense_sweep.toml")
    net = tiny_llama(layers=2, hidden=512)  # head_dim 128
    ids = torch.randint(1, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    views, stored = [], []
    for name in (flat_name, tiled_name):
        cache = build_cache(registry.resolve(name), net, tokenizer=CharTokenizer())
        with torch.no_grad():
            importance.prefill(net, cache, ids)
        views.append(cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu")))
        stored.append(cache.engine.view(1).values.coefficients["codes"])
    flat, tiled = views
    assert not flat.v_tiled and tiled.v_tiled and tiled.tokens % 64 == 0 and tiled.tokens > 64
    assert stored[1].nbytes == stored[0].nbytes and not torch.equal(tiled.v_codes, flat.v_codes)
    assert resolve_variant(tiled, "auto") == ("dense", 64)
    for group in (2, 4):  # one column a query head, and two (the tile's probabilities shared by both value groups)
        q = torch.randn(1, 2 * group, 128, generator=torch.Generator().manual_seed(5))
        twin = torch_lowbit_decode(tiled, q, None, 128 ** -0.5)
        assert torch.equal(twin, torch_lowbit_decode(flat, q, None, 128 ** -0.5))
        out = lowbit_decode(tiled, q, None, 128 ** -0.5)
        assert torch.allclose(out, twin, atol=1e-5) and float(twin.abs().max()) > 0.05
        offset_out = plan_launch(tiled, q, None, 128 ** -0.5).constants["LEVELS"] == 3  # 1 + code / 16, offset at the end
        assert offset_out == (group == 4 and tiled_name == "kzd-k4v4t-f77-d128")
        assert torch.allclose(out, lowbit_decode(flat, q, None, 128 ** -0.5, variant="dense"), atol=1e-5)
    for variant in ("wide", "general"):
        with pytest.raises(ValueError, match="stored in tiles of 64 tokens"):
            resolve_variant(tiled, variant)
    with pytest.raises(ValueError, match="steps of 64"):
        resolve_variant(tiled, "dense", 32)
