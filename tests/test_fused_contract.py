"""The fused kernel's contract (kernel plugin ``fused``): what it refuses to read, when, and with which words;
sliding-window layers through the mask; the packed formats it declares, unpacked as their quantizers pack them;
kernel modules that import no quantizer; attention that reads only the layer's view."""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest
import torch

import kvweave.kernels
import kvweave.plugins.kernels
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache
from kvweave.core.errors import ComponentError, ModelError, RegistryError
from kvweave.core.registry import load_pipeline, load_registry
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.formats import dequantize_int4_group, dequantize_int8_block, int4_group_width, int8_block_width
from kvweave.plugins.kernels.fused import FusedKernel

from conftest import ToyTokenizer, tiny_llama, write_registry

from test_kernels import DEVICE, filled, llama_config


@pytest.mark.parametrize(
    "body,error,words",
    [
        # refused when the pipeline is resolved (no model needed)
        ('residual_mode = "channels"', RegistryError, "residual_mode"),
        ('[pipelines.bad.evictor]\nuse = "streaming-llm"\nsinks = 4', RegistryError, "slot 'evictor' .* evicts"),
        ("block_tokens = 48", RegistryError, "block_tokens 48 must be a multiple of 32"),
        ('[pipelines.bad.router]\nlevels = [0, 2, 4, 6, 8]', RegistryError, "at most 3 residual rank levels"),
        ('[pipelines.bad.basis]\nuse = "identity"', RegistryError, "slot 'basis' .*no factor_bases"),
        ('[pipelines.bad.kernel]\nsplit_tokens = 48', Exception, "multiple of 32"),
        ('[pipelines.bad.kernel]\nvariant = "fast"', Exception, "variant"),
        ('[pipelines.bad.kernel]\ncombine = "three-pass"', Exception, "combine"),
        # refused when the cache is built for a model
        ('[pipelines.bad.basis]\nrank = 80\n[pipelines.bad.router]\ntarget_reduction = 1.5', ComponentError, "above the kernel's 64"),
    ],
)
def test_fused_refuses_what_it_cannot_read(tmp_path, body, error, words):
    registry = write_registry(tmp_path, "bad", f'[pipelines.bad]\nextends = "depthweave-kv"\n{body}\n')
    with pytest.raises(error, match=words):
        KVWeaveCache(load_pipeline("bad", registry), llama_config(4, 2, 64))


def test_fused_refuses_unsupported_head_dim():
    with pytest.raises(ModelError, match="head_dim 96"):
        KVWeaveCache(load_pipeline("depthweave-kv"), llama_config(4, 2, 96))


def test_fused_refuses_attention_it_does_not_compute():
    """A model whose attention caps its logits (Gemma-2 style) gets an error at the first fused decode step."""
    from kvweave.engine.observation import _observing_attention

    model = tiny_llama(layers=4, hidden=256)
    cache = build_cache(load_pipeline("depthweave-kv"), model, tokenizer=ToyTokenizer())
    with torch.no_grad():
        model(input_ids=torch.randint(1, 128, (1, 40)), **cache_kwargs(model, cache))
        attention = model.model.layers[0].self_attn
        query = torch.randn(1, 4, 1, 64)
        cache.engine.observer.tap.pending = torch.randint(1, 128, (1, 1))  # what the embedding hook would see
        keys, values = cache.layers[0].update(torch.randn(1, 2, 1, 64), torch.randn(1, 2, 1, 64), 0)
        with pytest.raises(ModelError, match="softcap"):
            _observing_attention(attention, query, keys, values, None, softcap=50.0)


def test_fused_sliding_window_layers_follow_the_mask():
    """A model with sliding-window layers (Gemma-3 style, window 48, kept exactly by the cache and attended by
    the model's own attention) and a left-padded row: the full-attention layers decode through the fused
    kernel as through the reference path."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=256, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=48, max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
    )
    model = Gemma3ForCausalLM(config).eval()
    ids = torch.randint(1, 128, (2, 200))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0
    outputs = []
    for name in ("depthweave-kv", "depthweave-kv-reference-kernel"):
        cache = build_cache(load_pipeline(name), model, tokenizer=ToyTokenizer())
        with torch.no_grad():
            outputs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                          output_scores=True, return_dict_in_generate=True, **cache_kwargs(model, cache)))
    fused, reference = outputs
    assert torch.equal(fused.sequences, reference.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(fused.scores, reference.scores)) < 1e-4


PAIRINGS = textwrap.dedent(
    """
    [pipelines.fused-int4-coefficients]
    extends = "depthweave-kv"
    [pipelines.fused-int4-coefficients.quantizer]
    use = "int4-group"
    group = 16
    [pipelines.fused-int8-residuals]
    extends = "depthweave-kv"
    [pipelines.fused-int8-residuals.residual_quantizer]
    use = "int8-block"
    block = 2
    [pipelines.reference-int4-coefficients]
    extends = "depthweave-kv-reference-kernel"
    [pipelines.reference-int4-coefficients.quantizer]
    use = "int4-group"
    group = 16
    """
)


def test_resolving_fused_with_another_packed_format_names_both_slots(tmp_path):
    """A kernel reads the packed formats it declares; pairing it with a quantizer that packs another one is
    refused when the pipeline is resolved, naming both slots and what would work."""
    registry = load_registry(write_registry(tmp_path, "pairings", PAIRINGS))
    with pytest.raises(RegistryError) as coefficients:
        registry.resolve("fused-int4-coefficients")
    message = str(coefficients.value)
    assert "slot 'kernel' ('fused')" in message and "slot 'quantizer' ('int4-group')" in message
    assert "int8-block.v1" in message and "packs int4-group.v1" in message
    assert "use kernel 'reference' or quantizer 'int8-block'" in message
    with pytest.raises(RegistryError, match=r"slot 'kernel' \('fused'\) reads residuals packed as int4-group\.v1, but slot "
                                            r"'residual_quantizer' \('int8-block'\) packs int8-block\.v1"):
        registry.resolve("fused-int8-residuals")
    # the reference kernel reads any format; the fused kernel's own check refuses the same pairing
    resolved = registry.resolve("reference-int4-coefficients")
    assert resolved.component("kernel").materializes
    with pytest.raises(ComponentError, match=r"pipeline 'reference-int4-coefficients': slot 'kernel' \('reference'\) reads "
                                             r"coefficients packed as int8-block\.v1, but slot 'quantizer' \('int4-group'\)"):
        FusedKernel().check_pipeline(resolved, "kernel")
    FusedKernel().check_pipeline(load_pipeline("depthweave-kv"), "kernel")  # its own pipeline passes
    assert FusedKernel.coefficient_formats == ("int8-block.v1",) and FusedKernel.residual_formats == ("int4-group.v1",)


def _imported_modules(path: Path, package: str) -> set[str]:
    """Every module ``path`` imports (relative imports resolved against ``package``), TYPE_CHECKING ones included."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def test_kernels_import_no_quantizer():
    """Kernels know packed formats by their declared names (kernels/formats.py), never a quantizer class."""
    scanned = 0
    for package in (kvweave.kernels, kvweave.plugins.kernels):
        folder = Path(package.__file__).parent
        for path in sorted(folder.rglob("*.py")):
            imported = _imported_modules(path, package.__name__)
            wrong = sorted(name for name in imported if name == "kvweave.plugins.quantizers" or name.startswith("kvweave.plugins.quantizers."))
            assert not wrong, f"{path} imports {wrong}"
            scanned += 1
    assert scanned >= 7


@pytest.mark.parametrize("width,block", [(16, 16), (64, 16), (48, 8), (8, 64)])
def test_packed_formats_unpack_as_their_quantizers(width, block):
    """kernels/formats.py unpacks int8-block.v1 and int4-group.v1 exactly as the quantizers that declare them
    do, and finds the channels per scale from the shapes."""
    from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
    from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer

    torch.manual_seed(width + block)
    x = torch.randn(3, 5, width) * 4
    int8 = Int8BlockQuantizer(block=block)
    packed = int8.quantize(x)
    assert int8.packed_format == "int8-block.v1"
    assert torch.equal(dequantize_int8_block(packed["codes"], packed["scales"]), int8.dequantize(packed, torch.float32))
    assert int8_block_width(packed["codes"], packed["scales"]) == min(block, width)
    group = block if block % 2 == 0 else 2
    int4 = Int4GroupQuantizer(group=group)
    packed = int4.quantize(x)
    assert int4.packed_format == "int4-group.v1"
    assert torch.equal(dequantize_int4_group(packed["packed"], packed["scales"]), int4.dequantize(packed, torch.float32))
    assert torch.equal(dequantize_int4_group(packed["packed"], packed["scales"], torch.float16), int4.dequantize(packed, torch.float16))
    assert int4_group_width(packed["packed"], packed["scales"]) == min(group, width)


def test_attend_reads_only_the_layer_view(tmp_path):
    """``attend`` and ``packed_logsumexp`` take the layer's view, keep their tables in its scratch dict, and
    compute what the twin computes on the decode view built from it."""
    cache = filled(tmp_path, 4, 2, 64, 256, name="dw-kernel-torch")
    engine = cache.engine
    view = engine.view(1)
    assert view.keys.coefficient_format == "int8-block.v1" and view.keys.residual_format == "int4-group.v1"
    scratch = view.scratch
    scratch.clear()
    torch.manual_seed(3)
    query = torch.randn(2, 4, 1, 64, device=DEVICE)
    out = engine.kernel.attend(view, query, None, 0.125)
    assert out.shape == (2, 1, 4, 64)
    assert ("segments", view.group) in scratch
    expected = torch_decode(engine.kernel.decode_view(view, torch.device(DEVICE)), query[:, :, 0], None, 0.125)
    assert torch.allclose(out[:, 0], expected, atol=1e-6, rtol=1e-5)  # equal on a CPU; CUDA's index_add_ sums in any order
    lse = engine.kernel.packed_logsumexp(view, query, 0.125)
    assert lse.shape == (2, 4, 1) and torch.isfinite(lse).all()
    # the group of each residual level comes from the packed fields' widths (depthweave-kv: int4 group 2)
    assert all(level.group == min(2, level.rank) for level in engine.kernel.decode_view(view, torch.device(DEVICE)).k_levels)


@pytest.mark.parametrize("variant,combine", [("gather", "two-pass"), ("tiles", "one-pass")])
def test_the_kernel_setting_variant_picks_the_packed_token_pass(tmp_path, monkeypatch, variant, combine):
    """``[kernel] variant`` and ``combine`` reach the Triton launch, and the passes decode what the torch twin decodes."""
    import kvweave.plugins.kernels.fused as fused_plugin

    registry = write_registry(tmp_path, "v", f'[pipelines.v]\nextends = "depthweave-kv"\n[pipelines.v.kernel]\n'
                                             f'backend = "triton"\nvariant = "{variant}"\ncombine = "{combine}"\n')
    model = tiny_llama(layers=4, hidden=256).to(DEVICE)
    cache = build_cache(load_pipeline("v", registry), model, tokenizer=ToyTokenizer())
    seen, launch = [], fused_plugin.fused_decode
    monkeypatch.setattr(fused_plugin, "fused_decode", lambda *a, **k: seen.append((k["variant"], k["combine"])) or launch(*a, **k))
    ids = torch.randint(1, 128, (1, 150), device=DEVICE)
    with torch.no_grad():
        token = model(input_ids=ids, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
        view = cache.engine.view(0)
        query = torch.randn(1, 4, 1, 64, device=DEVICE)
        out = cache.engine.kernel.attend(view, query, None, 0.125)
    decode = cache.engine.kernel.decode_view(view, torch.device(DEVICE))
    assert seen and set(seen) == {(variant, combine)}
    assert (out[:, 0] - torch_decode(decode, query[:, :, 0], None, 0.125)).abs().max().item() < 1e-3
    del token
