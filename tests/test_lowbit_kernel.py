"""The ``lowbit`` kernel: decode attention read in place from channel-group keys (rotated at each token's
position in registers) and rotated-token values. The Triton kernel (under ``TRITON_INTERPRET=1`` on a CPU,
set by conftest.py) against its torch twin, and the twin against the reference path's reconstructed K/V."""

from __future__ import annotations

import textwrap

import attrs
import pytest
import torch

from kvweave.core.errors import ComponentError, ModelError, RegistryError
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.generation import generate
from kvweave.kernels.lowbit_decode import (
    VARIANTS as KERNELS, fast_path, lowbit_decode, plan_launch, resolve_variant, torch_keys, torch_lowbit_decode,
)

from conftest import CharTokenizer, tiny_llama, write_registry

#: the variants every storage is read with (the "dense" kernel reads keys stored after RoPE: tests/test_lowbit_dense.py)
DECODERS = [variant for variant in KERNELS if variant != "dense"]

VARIANTS = textwrap.dedent("""
    [pipelines.t-lowbit-post]
    extends = "prerope-k4v2-lowbit"
    key_space = "post-rope"

    [pipelines.t-lowbit-k2v4]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-k2v4.keys.quantizer]
    bits = 2
    outliers = 2
    [pipelines.t-lowbit-k2v4.values.quantizer]
    bits = 4
    levels = "uniform"

    [pipelines.t-lowbit-v4]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-v4.values.quantizer]
    bits = 4
    levels = "uniform"

    [pipelines.t-lowbit-k3v3]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-k3v3.keys.quantizer]
    bits = 3
    [pipelines.t-lowbit-k3v3.values.quantizer]
    bits = 3

    [pipelines.t-lowbit-layers]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-layers.values.quantizer]
    layer_bits = [3, 2]

    [pipelines.t-lowbit-knormal]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-knormal.keys.quantizer]
    levels = "normal"

    [pipelines.t-lowbit-alloc]
    extends = "prerope-a3v2"
    [pipelines.t-lowbit-alloc.kernel]
    use = "lowbit"

    [pipelines.t-lowbit-qa35v3]
    extends = "prerope-qa35v3"
    [pipelines.t-lowbit-qa35v3.kernel]
    use = "lowbit"

    [pipelines.t-lowbit-alloc-post]
    extends = "t-lowbit-alloc"
    key_space = "post-rope"
    [pipelines.t-lowbit-alloc-post.keys.quantizer]
    pairs = false
    outliers = 1
    mean_bits = 2.5

    [pipelines.t-lowbit-int4]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-int4.keys.quantizer]
    use = "int4-group"

    [pipelines.t-lowbit-log8]
    extends = "t-lowbit-qa35v3"
    [pipelines.t-lowbit-log8.values.quantizer]
    scale_format = "log8"

    [pipelines.t-lowbit-k4log8]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-k4log8.values.quantizer]
    scale_format = "log8"

    [pipelines.t-lowbit-kvzip]
    extends = "t-lowbit-log8"
    [pipelines.t-lowbit-kvzip.evictor]
    use = "kvzip"
    fraction = 0.5

    [pipelines.t-lowbit-kvzip-cg]
    extends = "t-lowbit-k4log8"
    [pipelines.t-lowbit-kvzip-cg.evictor]
    use = "kvzip"
    fraction = 0.6

    [pipelines.t-lowbit-sinks]
    extends = "t-lowbit-log8"
    [pipelines.t-lowbit-sinks.router]
    use = "sinks"
    sink_tokens = 4
    rank = 64
    [pipelines.t-lowbit-sinks.residual_quantizer]
    use = "none"
    dtype = "float16"

    [pipelines.t-lowbit-sinks-kvzip]
    extends = "t-lowbit-sinks"
    [pipelines.t-lowbit-sinks-kvzip.evictor]
    use = "kvzip"
    fraction = 0.5

    [pipelines.t-lowbit-sinks-cg]
    extends = "t-lowbit-k4log8"
    [pipelines.t-lowbit-sinks-cg.router]
    use = "sinks"
    sink_tokens = 3
    rank = 64
    kinds = "keys"
    [pipelines.t-lowbit-sinks-cg.residual_quantizer]
    use = "none"
    dtype = "float16"

    [pipelines.t-lowbit-sinks-int4]
    extends = "t-lowbit-sinks"
    [pipelines.t-lowbit-sinks-int4.residual_quantizer]
    use = "int4-group"

    [pipelines.t-lowbit-sinks-rank16]
    extends = "t-lowbit-sinks"
    [pipelines.t-lowbit-sinks-rank16.router]
    rank = 16

    [pipelines.t-lowbit-h2o]
    extends = "t-lowbit-log8"
    [pipelines.t-lowbit-h2o.evictor]
    use = "h2o"

    [pipelines.t-lowbit-w8]
    extends = "t-lowbit-log8"
    window_storage = "int8"

    [pipelines.t-lowbit-asym]
    extends = "prerope-k4v2-lowbit"
    [pipelines.t-lowbit-asym.values.quantizer]
    symmetric = false
""")


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    return load_registry(write_registry(tmp_path_factory.mktemp("lowbit"), "lowbit", VARIANTS))


@pytest.fixture(scope="module")
def model():
    return tiny_llama(torch.float32, hidden=256, layers=2)  # head_dim 64


def _generate(model, cache, ids, mask):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache))


@pytest.mark.parametrize("name", ["prerope-k4v2-lowbit", "t-lowbit-post", "t-lowbit-k2v4", "t-lowbit-k3v3", "t-lowbit-layers",
                                  "t-lowbit-alloc", "t-lowbit-qa35v3", "t-lowbit-alloc-post", "t-lowbit-log8", "t-lowbit-k4log8",
                                  "t-lowbit-sinks", "t-lowbit-sinks-cg", "t-lowbit-w8"])
def test_the_kernel_decodes_what_the_reference_path_decodes(model, registry, name):
    """A left-padded batch decodes to the same tokens, with the same scores to float rounding, as the same
    storage reconstructed and attended by the model's own sdpa."""
    ids = torch.randint(1, 128, (2, 200), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    pipeline = registry.resolve(name)
    reference = attrs.evolve(pipeline, slots={**pipeline.slots, "kernel": load_pipeline("prerope-k4v2").slots["kernel"]})
    ours, theirs = (_generate(model, build_cache(p, model), ids, mask) for p in (pipeline, reference))
    assert torch.equal(ours.sequences, theirs.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(ours.scores, theirs.scores)) < 1e-4


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["prerope-k4v2-lowbit", "t-lowbit-post", "t-lowbit-k2v4", "t-lowbit-v4", "t-lowbit-k3v3",
                                  "t-lowbit-alloc", "t-lowbit-qa35v3", "t-lowbit-alloc-post", "t-lowbit-log8", "t-lowbit-k4log8",
                                  "t-lowbit-sinks", "t-lowbit-sinks-cg"])
def test_the_triton_kernel_matches_its_torch_twin(model, registry, name):
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve(name), model)
    with torch.no_grad():  # one storage for the batch; the kernel's mask (a first visible position per row) below
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.tokens == 192 and view.exact_k.shape[-2] == 38
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0], dtype=torch.int32)
    # "auto" takes "dense" where it reads the storage, else "wide" in 32-token steps or "general" in 16-token steps,
    # which are launched below as they are
    auto, _ = resolve_variant(view, "auto")
    explicit = {"wide": None, "general": 16}
    for first in (start, None):
        twin = torch_lowbit_decode(view, q, first, 0.125)
        for variant in DECODERS:
            if variant == "auto" and auto in explicit:  # the same launch as the variant's own, checked without rerunning it
                ours, theirs = (plan_launch(view, q, first, 0.125, variant=v, block=explicit.get(v)) for v in ("auto", auto))
                assert ours.kernel is theirs.kernel and ours.constants == theirs.constants and ours.grid == theirs.grid
                continue
            kernel = lowbit_decode(view, q, first, 0.125, block=explicit.get(variant), variant=variant)
            assert torch.allclose(kernel, twin, atol=1e-5), (variant, (kernel - twin).abs().max())


def test_the_wide_kernel_refuses_what_it_cannot_read(model, registry):
    """Steps under 32 tokens (the sm_90 build disagreed with the twin there) and values in more than four channel
    groups are refused with the reason, before any launch."""
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve("prerope-k4v2-lowbit"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    q = torch.randn(2, 4, 64)
    with pytest.raises(ValueError, match="at least 32 tokens, got block=16"):
        plan_launch(view, q, None, 0.125, block=16, variant="wide")
    assert plan_launch(view, q, None, 0.125, block=32, variant="wide").kernel is not None
    narrow = attrs.evolve(view, v_group=8)  # eight groups of 8 channels at head_dim 64
    with pytest.raises(ValueError, match="at most 4 channel groups of at least 16"):
        plan_launch(narrow, q, None, 0.125, block=32, variant="wide")


def test_auto_takes_the_wide_kernel_where_it_reads_the_storage(model, registry):
    """The default launch reads every storage whose value groups fit the wide kernel and that the dense kernel does not
    read with it at 32-token steps (2/4-bit codes unpacked, 3-bit and channel-alloc codes read from their bytes; keys
    before RoPE at head_dim 64 are not the dense kernel's); 16-token steps asked for, or eight value groups, take the
    general kernel."""
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(2))
    picked = {}
    for name in ("prerope-k4v2-lowbit", "t-lowbit-k3v3", "t-lowbit-qa35v3"):
        cache = build_cache(registry.resolve(name), model)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
        picked[name] = (resolve_variant(view, "auto"), resolve_variant(view, "auto", 16))
        narrow = attrs.evolve(view, v_group=8)
        assert resolve_variant(narrow, "auto") == ("general", 16)
    assert picked == {name: (("wide", 32), ("general", 16)) for name in picked}


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["prerope-k4v2-lowbit", "t-lowbit-qa35v3"])
def test_head_dim_256_reads_four_value_groups(registry, name):
    """Gemma-3's head_dim: 128-channel key halves and four 64-channel value groups (the most the wide kernel takes),
    2/4-bit codes unpacked and channel-alloc / 3-bit codes read from their bytes."""
    model = tiny_llama(layers=2, hidden=1024)  # head_dim 256
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve(name), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.exact_k.shape[-1] == 256 and view.exact_k.shape[-1] // view.v_group == 4
    q = torch.randn(2, 4, 256, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0], dtype=torch.int32)
    twin = torch_lowbit_decode(view, q, start, 0.0625)
    for variant in ("wide", "general"):
        kernel = lowbit_decode(view, q, start, 0.0625, variant=variant)
        assert torch.allclose(kernel, twin, atol=1e-5), (variant, (kernel - twin).abs().max())


@pytest.mark.interpreter
def test_two_bit_keys_at_head_dim_128_take_the_wide_kernel(registry):
    """At D = 128 a half-head of 2-bit keys is 16 bytes, unpacked by two interleaves."""
    model = tiny_llama(layers=2, hidden=512)
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve("t-lowbit-k2v4"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.k_bits == 2 and view.exact_k.shape[-1] == 128 and fast_path(view)
    q = torch.randn(2, 4, 128, generator=torch.Generator().manual_seed(3))
    twin = torch_lowbit_decode(view, q, torch.tensor([40, 0], dtype=torch.int32), 0.125)
    kernel = lowbit_decode(view, q, torch.tensor([40, 0], dtype=torch.int32), 0.125, variant="wide")
    assert torch.allclose(kernel, twin, atol=1e-5), (kernel - twin).abs().max()


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["t-lowbit-kvzip", "t-lowbit-kvzip-cg", "t-lowbit-sinks-kvzip"])
def test_a_cache_that_dropped_tokens_decodes_as_the_reference_path(model, registry, name):
    """KVzip keeps about half of the context: the kernel reads each slot at its cache index (keys rotated there)
    and decodes the same tokens, with the same scores to float rounding, as the reference path; the Triton
    kernels equal the twin on that storage."""
    ids = torch.randint(1, 128, (2, 260), generator=torch.Generator().manual_seed(4))
    pipeline = registry.resolve(name)
    reference = attrs.evolve(pipeline, slots={**pipeline.slots, "kernel": load_pipeline("prerope-k4v2").slots["kernel"]})
    runs = []
    for p in (pipeline, reference):
        cache = build_cache(p, model, tokenizer=CharTokenizer())
        new, _ = generate(model, {"input_ids": ids}, cache, max_new_tokens=12, do_sample=False, output_scores=True,
                          return_dict_in_generate=False, pad_token_id=0)
        runs.append((new, cache))
    (ours, cache), (theirs, _) = runs
    assert torch.equal(ours, theirs)
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    positions = view.positions
    assert positions is not None and view.tokens < 0.8 * view.exact_first  # tokens were dropped
    assert bool((positions >= 0).all())  # a kvzip cache has no filler slots
    assert bool((positions[:, 1:] > positions[:, :-1]).all())  # in order
    restored = 0 if view.restored_pos is None else int((view.restored_pos[0, 0] >= 0).sum())
    hidden = 0 if view.hidden_slots is None else int((view.hidden_slots[0] >= 0).sum())
    assert hidden == restored  # the slots of tokens a full-rank residual restores are hidden from the packed pass
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(5))
    twin = torch_lowbit_decode(view, q, None, 0.125)
    for variant in DECODERS:
        kernel = lowbit_decode(view, q, None, 0.125, block=None if variant in ("auto", "wide") else 16, variant=variant)
        assert torch.allclose(kernel, twin, atol=1e-5), (variant, (kernel - twin).abs().max())
    moved = attrs.evolve(view, positions=positions + 7)  # the rotation follows the slots' positions
    assert not torch.allclose(torch_lowbit_decode(moved, q, None, 0.125), twin, atol=1e-3)


# Builds one kernel for an sm_90 target from the job on stdin (no GPU needed: Triton carries its own ptxas); run in a
# process of its own, since conftest.py puts this one in interpreter mode.
def test_keys_rotated_in_registers_are_the_keys_the_engine_rotates(model):
    ids = torch.randint(1, 128, (1, 150), generator=torch.Generator().manual_seed(4))
    cache = build_cache(load_pipeline("prerope-k4v2-lowbit"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(0), torch.device("cpu"))
    ours = torch_keys(view).reshape(1, 2, view.tokens, 64)
    engine = cache.engine.reconstruct(0, "keys", torch.float32)
    assert torch.allclose(ours, engine, atol=1e-4)


@pytest.mark.parametrize("name, match", [
    ("t-lowbit-knormal", "uniform 2, 3, 4-bit codes"),
    ("t-lowbit-int4", "packed as channel-group.v1 or channel-alloc.v1"),
    ("t-lowbit-asym", "symmetric 2, 3, 4-bit"),
    ("t-lowbit-sinks-int4", "residuals only as whole restored vectors .* 'int4-group'"),
    ("t-lowbit-h2o", "accumulates attention or re-selects"),
])
def test_storage_the_kernel_cannot_read_is_refused_at_resolve_time(registry, name, match):
    with pytest.raises((RegistryError, ComponentError), match=match):
        registry.resolve(name)


def test_residuals_below_full_rank_are_refused_when_the_cache_is_built(registry, model):
    with pytest.raises(ModelError, match=r"residual ranks \[16\] are below this model's head_dim 64; set the router's rank = 64 "
                       r"\(\[pipelines.t-lowbit-sinks-rank16.router\]"):
        build_cache(registry.resolve("t-lowbit-sinks-rank16"), model)
