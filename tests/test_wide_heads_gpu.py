"""head_dim 256 (Gemma-2-9B's, Gemma-3's) on a GPU: the quantizers' packing kernels store the bytes their torch paths
store, the dense decode kernel reads the 8x and ~5x classes' storages within the twin's bound, and a Gemma-3 model of
head_dim 256 decodes through the default launch as through the reference path. On a CPU the kernels run in Triton's
interpreter, which does not know the GPU's limits (at head_dim 256 the packing kernels once asked for more shared
memory than an H100 has, and could not launch): ``tests/test_pack_kernels.py`` and ``tests/test_lowbit_dense.py`` hold
the CPU side. Skipped without CUDA."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import attrs
import pytest
import torch

from kvweave.core.registry import load_registry, load_pipeline
from kvweave.engine import build_cache, cache_kwargs
from kvweave.kernels import pack
from kvweave.kernels.lowbit_decode import lowbit_decode, plan_launch, torch_lowbit_decode
from kvweave.plugins.quantizers.channel_alloc import ChannelAllocQuantizer
from kvweave.plugins.quantizers.channel_group import ChannelGroupQuantizer
from kvweave.plugins.quantizers.rotated_token import RotatedTokenQuantizer

from conftest import CharTokenizer, write_registry
from test_pack_kernels import _both, _keys, _same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles the kernels for a CUDA GPU")

#: the 8x class's storage at head_dim 256 without eviction (every token packed): 4-bit channel-group keys after RoPE,
#: 2-bit values with one-byte scales in tiles of 64 tokens
PIPELINES = textwrap.dedent("""
    [pipelines.t-d256-k4v2t]
    extends = "prerope-k4v2-lowbit"
    key_space = "post-rope"
    [pipelines.t-d256-k4v2t.keys.quantizer]
    use = "channel-group"
    bits = 4
    group = 64
    outliers = 0
    [pipelines.t-d256-k4v2t.values.quantizer]
    bits = 2
    scale_format = "log8"
    token_tiles = 64
""")


def test_the_quantizers_pack_head_dim_256_on_the_gpu(monkeypatch):
    """A real block's shape (8 KV heads, 4,096 tokens) at head_dim 256: the kernels launch and store the torch paths'
    bytes (4-bit keys and values: 128 bytes a token, packed in two parts of channels)."""
    x = _keys((1, 8, 4096, 256), torch.bfloat16, seed=6).cuda()
    for quantizer in (ChannelGroupQuantizer(bits=4, group=64, outliers=0), ChannelAllocQuantizer(mean_bits=3.5),
                      RotatedTokenQuantizer(bits=4, symmetric=False), RotatedTokenQuantizer(bits=3, scale_format="log8"),
                      RotatedTokenQuantizer(bits=2, token_tiles=64, scale_format="log8")):
        _same(*_both(monkeypatch, quantizer, x))


@pytest.mark.parametrize("storage", ["k4v2e48", "k4v2e48t", "k4v4e77t"])
def test_the_dense_kernel_reads_head_dim_256_on_the_gpu(storage, monkeypatch):
    """16 query heads on 8 KV heads, four value groups, the 8x and ~5x classes' storages, 16,384 tokens before
    eviction: the default launch takes the dense kernel, at one row (one wave of programs, the combine launched early)
    and at two, each within the twin's bound (the query rounded to bfloat16, as at head_dim 128); the same bits at one
    row with the early combine off."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from lowbit_kernel import SHAPES, packed_view

    from kvweave.kernels import launch as launches
    from kvweave.kernels import lowbit_dense
    from kvweave.kernels.lowbit_decode import resolve_variant

    q_heads, _, dim, _ = SHAPES["d256"]
    for rows in (1, 2):
        view = attrs.evolve(packed_view(rows, 16384, device="cuda", storage=storage, shape="d256"), inv_freq=None)
        assert view.exact_k.shape[-1] == 256 and resolve_variant(view, "auto") == ("dense", 64)
        q = torch.randn(rows, q_heads, dim, generator=torch.Generator().manual_seed(11)).cuda()
        start = torch.tensor([500, 0][:rows], dtype=torch.int32, device="cuda")
        twin = torch_lowbit_decode(view, q, start, dim ** -0.5)
        noise = float((torch_lowbit_decode(view, q.bfloat16().float(), start, dim ** -0.5) - twin).abs().max())
        bound = 0.03 * float(twin.abs().max()) + 6 * noise
        out = lowbit_decode(view, q, start, dim ** -0.5, variant="auto", programs=None)
        assert float((out - twin).abs().max()) < bound, (storage, rows, float((out - twin).abs().max()), bound)
        if rows == 1:
            launch = plan_launch(view, q, start, dim ** -0.5, variant="auto", programs=None)
            assert launch.kernel is lowbit_dense.jit_dense._lowbit_dense_kernel
            monkeypatch.setattr(launches, "PROGRAMMATIC_COMBINE", False)
            after = lowbit_decode(view, q, start, dim ** -0.5, variant="auto", programs=None)
            monkeypatch.undo()
            assert torch.equal(out, after), float((out - after).abs().max())


def test_a_head_dim_256_model_decodes_as_the_reference_path_on_the_gpu(tmp_path, monkeypatch):
    """A random Gemma-3 text model of head_dim 256 (sliding-window and global layers, 4 query heads on 2 KV heads),
    float32, a left-padded batch of 300 prompt tokens: the 8x class's storage (keys after RoPE, values in tiles) decoded
    by the default launch (the dense kernel, which the test sees called) gives the reference path's scores (the same
    storage reconstructed and attended by the model's own attention) to the kernel's bfloat16 operands' rounding."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from kvweave.kernels import lowbit_decode as decode

    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=256, sliding_window=512, max_position_embeddings=2048,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    )
    model = Gemma3ForCausalLM(config).to("cuda").eval()
    registry = load_registry(write_registry(tmp_path, "d256", PIPELINES))
    pipeline = registry.resolve("t-d256-k4v2t")
    reference = attrs.evolve(pipeline, slots={**pipeline.slots, "kernel": load_pipeline("prerope-k4v2").slots["kernel"]})
    ids = torch.randint(1, 128, (2, 300), generator=torch.Generator().manual_seed(1)).cuda()
    mask = torch.ones_like(ids)
    mask[1, :23] = 0
    variants = []
    monkeypatch.setattr(decode, "plan_launch", lambda *a, original=decode.plan_launch, **k: (
        lambda launch: variants.append(launch.kernel) or launch)(original(*a, **k)))
    runs = []
    for chosen in (pipeline, reference):
        cache = build_cache(chosen, model, tokenizer=CharTokenizer())
        with torch.no_grad():
            runs.append(model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                       output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                                       **cache_kwargs(model, cache)))
    from kvweave.kernels import lowbit_dense

    assert variants and all(kernel is lowbit_dense.jit_dense._lowbit_dense_kernel for kernel in variants)
    ours, theirs = runs
    same = (ours.sequences[:, 300:] == theirs.sequences[:, 300:]).all(0).long().cumprod(0).sum()  # steps before a change
    for a, b in list(zip(ours.scores, theirs.scores))[: int(same) + 1]:  # the scores of the same prompts
        assert bool(torch.isfinite(a).all())
        assert float((a - b).abs().max()) < 0.02 * float(b.abs().max()), float((a - b).abs().max())
