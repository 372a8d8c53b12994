"""The conversions the ``lowbit`` kernels can leave out (``TRICKS``): each gives what the kernel computes without it,
under Triton's interpreter where it uses float32 operands ('magic', 'kfold'), and each builds for sm_90 (the bfloat16
operands of 'vb16' and 'ktf32', which the interpreter does not compute; tests/test_lowbit_gpu.py runs them on a GPU)."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.engine import build_cache, cache_kwargs
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode, whole_byte_codes

from conftest import tiny_llama
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model
from test_lowbit_kernel_host import _nvidia_backend, compile_for_gpu


def _packed(model, registry, name: str, rows: int = 2):
    """The lowbit view of layer 1 after one forward of ``rows`` random rows of 230 tokens through ``name``'s cache."""
    ids = torch.randint(1, 128, (rows, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve(name), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    return cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["prerope-k4v2-lowbit", "t-lowbit-k3v3", "t-lowbit-qa35v3", "t-lowbit-v4"])
def test_codes_made_float_by_their_bits_give_the_twins_output(model, registry, name):
    """The 'magic' trick (codes ORed into the mantissa of 2**23, 2**23 subtracted) leaves a conversion out, not
    arithmetic: both kernels give the twin's output to float32 rounding, on 3- and 4-bit channel-group and
    channel-alloc keys and uniform, normal and tabled value levels (post-RoPE keys below, with 'kfold'). (The bfloat16
    tricks need the GPU's operands, which the interpreter does not compute: they are compiled below and run in
    test_lowbit_gpu.py.)"""
    view = _packed(model, registry, name)
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0], dtype=torch.int32)
    twin = torch_lowbit_decode(view, q, start, 0.125)
    for variant in ("wide", "general"):
        block = 32 if variant == "wide" else 16
        magic = lowbit_decode(view, q, start, 0.125, block=block, variant=variant, tricks="magic")
        assert torch.allclose(magic, twin, atol=1e-5), (variant, (magic - twin).abs().max())


@pytest.mark.interpreter
@pytest.mark.parametrize("name", ["t-lowbit-post", "t-lowbit-v4", "t-lowbit-k2v4"])
def test_keys_after_rope_with_scales_folded_into_the_query_give_the_twins_output(model, registry, name):
    """'kfold': each channel's scale and minimum folded into the query, the codes fed to the products as 128 + code,
    exact outliers added as corrections: the twin's output (keys read as stored after RoPE: the pre-RoPE storages
    with their rotation left out, as `benchmarks/lowbit_kernel.py --post-rope` reads them). 2- and 4-bit keys with
    one or two outliers, head_dim 64 and 128; storages it cannot read are refused."""
    rotated = _packed(tiny_llama(layers=2, hidden=512) if name == "t-lowbit-k2v4" else model, registry, name)
    view = attrs.evolve(rotated, inv_freq=None)
    dim = view.exact_k.shape[-1]
    q = torch.randn(2, 4, dim, generator=torch.Generator().manual_seed(3))
    start = torch.tensor([40, 0], dtype=torch.int32)
    twin = torch_lowbit_decode(view, q, start, dim ** -0.5)
    for tricks in ("kfold", "kfold+magic"):
        out = lowbit_decode(view, q, start, dim ** -0.5, variant="wide", tricks=tricks)
        assert torch.allclose(out, twin, atol=2e-5), (tricks, (out - twin).abs().max())
    if rotated.inv_freq is not None:
        with pytest.raises(ValueError, match="'kfold' trick folds channel scales"):
            lowbit_decode(rotated, q, start, dim ** -0.5, variant="wide", tricks="kfold")


def test_conversion_tricks_refuse_what_they_cannot_change(model, registry):
    view = _packed(model, registry, "prerope-k4v2-lowbit", rows=1)
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="tricks \\['fast'\\]: expected"):
        lowbit_decode(view, q, None, 0.125, tricks="magic+fast")
    with pytest.raises(ValueError, match="bfloat16 tile operands of a GPU"):
        lowbit_decode(view, q, None, 0.125, variant="wide", tricks="vb16")
    with pytest.raises(ValueError, match="'general' kernel takes only the 'magic' trick"):
        lowbit_decode(view, q, None, 0.125, block=16, variant="general", lowp=True, tricks="ktf32")


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("name", ["prerope-k4v2-lowbit", "t-lowbit-v4", "t-lowbit-qa35v3"])
def test_the_conversion_tricks_compile_for_the_gpu(model, registry, name):
    """Each trick of TRICKS builds for sm_90 on normal (k4v2), uniform (v4) and tabled (qa35v3) value levels."""
    view = _packed(model, registry, name, rows=1)
    q = torch.randn(1, 4, 64)
    post = attrs.evolve(view, inv_freq=None)  # read as keys stored after RoPE, for 'kfold'
    for variant, tricks in (("wide", "magic+vb16"), ("wide", "ktf32"), ("general", "magic"), ("wide", "kfold+vb16")):
        read = post if "kfold" in tricks else view
        if "kfold" in tricks and not whole_byte_codes(view)[0]:
            continue
        launch = plan_launch(read, q, None, 0.125, block=32 if variant == "wide" else 16, variant=variant, lowp=True, tricks=tricks)
        assert launch.constants["MAGIC"] == ("magic" in tricks)
        stats = compile_for_gpu(launch)
        assert stats["cubin"] > 0 and stats["ptx"] > 100, (variant, tricks, stats)


PIPELINE_TRICKS = """
[pipelines.t-tricks-magic]
extends = "prerope-k4v2-lowbit"
[pipelines.t-tricks-magic.kernel]
use = "lowbit"
backend = "triton"
tricks = "magic"

[pipelines.t-tricks-vb16]
extends = "t-tricks-magic"
[pipelines.t-tricks-vb16.kernel]
use = "lowbit"
backend = "triton"
tricks = "vb16"

[pipelines.t-tricks-typo]
extends = "prerope-k4v2-lowbit"
[pipelines.t-tricks-typo.kernel]
use = "lowbit"
tricks = "magic+vb61"
"""


@pytest.mark.interpreter
def test_a_pipeline_asks_for_tricks_and_the_kernel_launches_with_them(model, tmp_path, monkeypatch):  # noqa: F811
    """registry.toml's ``tricks`` reaches every Triton launch of the layer and changes no token ('magic' under the
    interpreter); a misspelt trick is refused when the pipeline is resolved, naming it; one the launch cannot take
    ('vb16' on float32 operands) is refused when the layer first decodes, naming the layer."""
    from kvweave.core.errors import ComponentError, RegistryError
    from kvweave.core.registry import load_registry
    from kvweave.plugins.kernels import lowbit as plugin

    from conftest import write_registry

    registry = load_registry(write_registry(tmp_path, "tricks", PIPELINE_TRICKS))
    with pytest.raises((RegistryError, ComponentError), match=r"t-tricks-typo.*'tricks'.*'magic\+vb61'"):
        registry.resolve("t-tricks-typo")
    asked = []
    real = plugin.lowbit_decode
    monkeypatch.setattr(plugin, "lowbit_decode", lambda *a, **k: asked.append(k.get("tricks")) or real(*a, **k))
    ids = torch.randint(1, 128, (1, 230), generator=torch.Generator().manual_seed(2))

    def decode(name: str, steps: int):
        cache = build_cache(registry.resolve(name), model)
        with torch.no_grad():
            return model.generate(input_ids=ids, max_new_tokens=steps, do_sample=False, output_scores=True,
                                  return_dict_in_generate=True, pad_token_id=0, **cache_kwargs(model, cache))

    runs = {name: decode(name, 3) for name in ("prerope-k4v2-lowbit", "t-tricks-magic")}
    assert asked and set(asked) == {"magic"}  # the default pipeline runs the torch twin on a CPU: no launch
    plain, magic = runs["prerope-k4v2-lowbit"], runs["t-tricks-magic"]
    assert torch.equal(plain.sequences, magic.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(plain.scores, magic.scores)) < 1e-4
    with pytest.raises(ComponentError, match=r"layer \d+: kernel 'lowbit' with tricks 'vb16': .*bfloat16"):
        decode("t-tricks-vb16", 2)


def test_tabled_value_levels_are_made_bfloat16_once_with_the_view(model, registry):  # noqa: F811
    """The 'vb16' trick reads tabled value levels (3-bit normal levels) as bfloat16: the plugin's view holds them
    converted once per storage state, and the launch passes that tensor instead of converting per call."""
    view = _packed(model, registry, "t-lowbit-k3v3")
    assert view.level_kind[0] == 0 and view.v_levels16 is not None
    assert torch.equal(view.v_levels16, view.v_levels.to(torch.bfloat16))
    q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(3))
    launch = plan_launch(view, q, None, 0.125, lowp=True, tricks="vb16")
    assert launch.args[-1] is view.v_levels16
    again = plan_launch(attrs.evolve(view, v_levels16=None), q, None, 0.125, lowp=True, tricks="vb16")
    assert again.args[-1].dtype == torch.bfloat16 and torch.equal(again.args[-1], view.v_levels16)
