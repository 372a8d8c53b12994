"""The fused decode kernel (kernels/: the Triton kernel, its torch twin, the packed formats; kernel plugin ``fused``).

On a machine without CUDA the Triton kernel runs under ``TRITON_INTERPRET=1`` (set by conftest.py) at tiny
sizes; on the GPU machine the same tests run the compiled kernel, plus the real-size cases marked ``gpu``.
Each compares, on storage written by the real engine: the kernel, its torch twin, and the reference path
(the engine's reconstruction followed by plain softmax attention).
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from transformers import LlamaConfig

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.cache import KVWeaveCache
from kvweave.core.registry import load_pipeline
from kvweave.engine.residuals import ResidualList
from kvweave.engine.synthetic import fill_cache
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.decode_view import DecodeView, choose_split
from kvweave.kernels.depthweave_decode import fused_decode

from conftest import ToyTokenizer, tiny_llama, write_registry

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"

# depthweave-kv with a budget that leaves room for residuals at these few tokens, and a basis version
# every 2 blocks so that segments change version
REGISTRY = textwrap.dedent(
    """
    [pipelines.dw-kernel]
    extends = "depthweave-kv"
    [pipelines.dw-kernel.basis]
    update_every = 2
    [pipelines.dw-kernel.router]
    target_reduction = 2.0
    [pipelines.dw-kernel-triton]
    extends = "dw-kernel"
    [pipelines.dw-kernel-triton.kernel]
    backend = "triton"
    [pipelines.dw-kernel-torch]
    extends = "dw-kernel"
    [pipelines.dw-kernel-torch.kernel]
    backend = "torch"
    """
)


def llama_config(q_heads: int, kv_heads: int, head_dim: int, layers: int = 4) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128, hidden_size=q_heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
    )


def filled(
    tmp_path, q_heads: int, kv_heads: int, head_dim: int, tokens: int, batch: int = 2, chunks: int = 3, name: str = "dw-kernel"
) -> KVWeaveCache:
    pipeline = load_pipeline(name, write_registry(tmp_path, "kernel", REGISTRY))
    cache = KVWeaveCache(pipeline, llama_config(q_heads, kv_heads, head_dim))
    return fill_cache(cache, batch, tokens, chunk=-(-tokens // chunks), dtype=torch.bfloat16, device=DEVICE, seed=head_dim)


def decode_view(cache: KVWeaveCache, layer: int) -> DecodeView:
    """What the fused kernel reads of ``layer``: its decode view of the engine's :class:`LayerView`."""
    return cache.engine.kernel.decode_view(cache.engine.view(layer), torch.device(DEVICE))


def reference_attention(
    cache: KVWeaveCache, layer: int, query: torch.Tensor, start: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Softmax attention over the engine's reconstruction of ``layer`` in ``dtype`` (the reference path: bf16 K/V
    in a bf16 model), computed in float32, rows masked before ``start``."""
    engine = cache.engine
    stored = engine.view(layer)
    keys = torch.cat((engine.reconstruct(layer, "keys", dtype), stored.keys.exact.to(dtype)), dim=-2).float()
    values = torch.cat((engine.reconstruct(layer, "values", dtype), stored.values.exact.to(dtype)), dim=-2).float()
    batch, q_heads, dim = query.shape
    group = q_heads // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    logits = torch.einsum("bgd,bgtd->bgt", query.to(dtype).float(), keys) * scale
    hidden = torch.arange(keys.shape[-2], device=keys.device)[None, :] < start[:, None]
    probs = logits.masked_fill(hidden[:, None, :], float("-inf")).softmax(dim=-1)
    return torch.einsum("bgt,bgtd->bgd", probs, values)


@pytest.mark.parametrize(
    "q_heads,kv_heads,head_dim,tokens",
    [(8, 2, 128, 320), (3, 1, 64, 288), (2, 2, 256, 288)],
    ids=["llama3-gqa4-d128", "smollm2-gqa3-d64", "mha-d256"],
)
def test_kernel_matches_twin_and_reference(tmp_path, q_heads, kv_heads, head_dim, tokens):
    cache = filled(tmp_path, q_heads, kv_heads, head_dim, tokens)
    layer = 1
    view = decode_view(cache, layer)
    # the storage exercises what the kernel must handle
    assert view.packed_tokens == cache.engine.view(layer).packed_tokens > 0
    assert view.segments[:, 2].unique().numel() >= 2, "several basis versions"
    assert sum(level.entries for level in view.k_levels + view.v_levels) > 0, "routed residuals"
    torch.manual_seed(0)
    query = torch.randn(2, q_heads, head_dim, device=DEVICE)
    start = torch.tensor([0, 45], dtype=torch.int32, device=DEVICE)  # the second row left-padded by 45 tokens
    scale = head_dim**-0.5
    expected = reference_attention(cache, layer, query, start, scale)
    twin = torch_decode(view, query, start, scale)
    kernel = fused_decode(view, query, start, scale, split=64)
    assert torch.allclose(twin, expected, atol=2e-5, rtol=1e-4), (twin - expected).abs().max()
    # the kernel multiplies float16 operands on tensor cores (float32 sums): within 1e-3 of the float32
    # twin, and closer to it than the reference path itself is when the model runs in bf16
    kernel_error = (kernel - twin).abs().max().item()
    reference_error = (reference_attention(cache, layer, query, start, scale, torch.bfloat16) - twin).abs().max().item()
    assert kernel_error < 1e-3 and kernel_error < reference_error, (kernel_error, reference_error)
    # padding matters: without it the second row differs
    assert not torch.allclose(fused_decode(view, query, None, scale, split=64)[1], kernel[1], atol=1e-4)


def test_kernel_segments_and_splits_agree(tmp_path):
    """The split into programs and the tokens per loop iteration change nothing but rounding."""
    cache = filled(tmp_path, 4, 2, 64, 256, batch=1)
    view = decode_view(cache, 0)
    query = torch.randn(1, 4, 64, device=DEVICE)
    outputs = [fused_decode(view, query, None, 0.125, split=split) for split in (32, 96, 4096)]
    outputs += [fused_decode(view, query, None, 0.125, split=64, block_tokens=block, variant=variant)
                for variant, block in (("gather", 32), ("gather", 256), ("tiles", 32), ("tiles", 64))]
    for other in outputs[1:]:
        assert torch.allclose(outputs[0], other, atol=1e-3, rtol=1e-2)



def test_split_fills_the_gpu_without_a_nearly_empty_last_wave():
    assert choose_split(131008, 8) == 1024  # B = 1, 8 KV heads: 128 segments per row, 1,024 programs
    # B = 8 and 32 (64 and 256 rows): one wave of about 1,584 programs (12 an SM), at most 5,472 tokens each
    assert [-(-32768 // choose_split(32768, rows)) * rows for rows in (64, 256)] == [1536, 1536]
    assert [choose_split(t, 64) for t in (32768, 65536, 131072)] == [1376, 2752, 5472]
    assert choose_split(131072, 256) == 5472 and choose_split(131072, 512) == 2048  # past B = 32: the rule below
    assert choose_split(4000, 8) == 256  # short caches: at least 256 tokens per program
    assert all(choose_split(t, rows) % 32 == 0 for t in (999, 65536, 131072) for rows in (1, 8, 960))

def test_kernel_with_bf16_exact_window(tmp_path):
    pipeline = load_pipeline("dw-kernel", write_registry(tmp_path, "kernel", REGISTRY))
    cache = fill_cache(KVWeaveCache(pipeline, llama_config(4, 2, 64)), 2, 224, chunk=112, dtype=torch.bfloat16, device=DEVICE)
    view = decode_view(cache, 2)
    assert view.exact_k.dtype == torch.bfloat16
    query = torch.randn(2, 4, 64, device=DEVICE).to(torch.bfloat16)
    kernel = fused_decode(view, query, None, 0.125, split=64)
    twin = torch_decode(view, query, None, 0.125)
    assert kernel.dtype == torch.bfloat16
    assert torch.allclose(kernel.float(), twin.float(), atol=1e-2, rtol=1e-2)



def test_kernel_after_the_batch_grows_and_flushes_again(tmp_path):
    """A cache grown by batch selection (beam search, or the e2e benchmark's larger batches) re-indexes every
    residual list, also the levels without entries, and the kernel reads the blocks appended after it."""
    cache = filled(tmp_path, 8, 2, 128, 192)
    engine = cache.engine
    engine.select_batch(torch.tensor([0, 1, 0]))
    fill_cache(cache, 3, 128, chunk=64, dtype=torch.bfloat16, device=DEVICE, seed=7)  # two more flushes
    view = decode_view(cache, 1)
    assert view.packed_tokens == engine.view(1).packed_tokens and view.k_codes.shape[0] == 3
    assert all(level.tile_start.shape[0] == 3 * 2 for level in view.k_levels + view.v_levels)
    assert torch.equal(view.k_codes[0, :, :192], view.k_codes[2, :, :192])  # the repeated row's first blocks
    query = torch.randn(3, 8, 128, device=DEVICE)
    start = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    expected = reference_attention(cache, 1, query, start, 128**-0.5)
    twin = torch_decode(view, query, start, 128**-0.5)
    kernel = fused_decode(view, query, start, 128**-0.5, split=64)
    assert torch.allclose(twin, expected, atol=2e-5, rtol=1e-4), (twin - expected).abs().max()
    assert (kernel - twin).abs().max().item() < 1e-3

def test_a_residual_list_holds_where_its_entries_are_as_bits_and_finds_them_again():
    """Entries appended block by block store no row or token: the list's bits and block starts give back each entry's
    (row, token) in the order held, blocks of any length included, and the tile index kept as blocks arrive equals the
    one rebuilt from scratch (from int64 rows and tokens, as a re-indexing gives them). nbytes is the values, the bits,
    the block starts and the tile starts."""
    torch.manual_seed(0)
    rows, tile, cpu = 6, 32, torch.device("cpu")
    kept, rebuilt, loose = ResidualList(4, tiles=True), ResidualList(4), ResidualList(4)
    appended = []
    for block in range(3):  # blocks of 64 tokens, entries sorted by row then token, as the engine appends them
        picked = [(r, t) for r in range(rows) for t in sorted(torch.randperm(64)[:20].tolist())]
        row = torch.tensor([r for r, _ in picked], dtype=torch.int32)
        token = torch.tensor([t + 64 * block for _, t in picked], dtype=torch.int32)
        values = torch.randint(0, 255, (len(picked), 2), dtype=torch.uint8)
        kept.append({"row": row, "token": token, "q_packed": values}, 64 * block, 64, rows)
        rebuilt.append({"row": row.long(), "token": token.long(), "q_packed": values}, 64 * block, 64, rows)  # int64 too
        appended.append((row, token, values))
    row_of, token_of = (torch.cat([a[i] for a in appended]) for i in range(2))
    assert kept.entries == row_of.numel() and "row" not in kept.fields and "token" not in kept.fields
    assert all(torch.equal(a, b) for a, b in zip(kept.located(), (row_of, token_of)))
    assert torch.equal(kept.fields["q_packed"], torch.cat([a[2] for a in appended]))
    start, mask = kept.tile_index(rows, 6, cpu)
    assert all(torch.equal(a, b) for a, b in zip((start, mask), rebuilt.tile_index(rows, 6, cpu)))
    bits = mask.long() & 0xFFFFFFFF
    for r in range(rows):
        for t in range(6):
            chosen = ((row_of == r) & (token_of // tile == t)).nonzero().squeeze(1)
            assert int(bits[r, t]) == sum(1 << int(token_of[i] % tile) for i in chosen)
            for i in chosen.tolist():  # start + popcount(bits below) finds each entry
                below = int(bits[r, t]) & ((1 << int(token_of[i] % tile)) - 1)
                assert int(start[r, t]) + bin(below).count("1") == i
    assert kept.nbytes() == kept.fields["q_packed"].nbytes + mask.nbytes + start.nbytes + 3 * 4  # three block starts
    for first, count in ((0, 40), (40, 7), (47, 90)):  # blocks that start and end inside words
        picked = [(r, t) for r in range(rows) for t in sorted(torch.randperm(count)[: count // 3].tolist())]
        loose.append({"row": torch.tensor([r for r, _ in picked], dtype=torch.int32),
                      "token": torch.tensor([first + t for _, t in picked], dtype=torch.int32),
                      "q_packed": torch.zeros(len(picked), 2, dtype=torch.uint8)}, first, count, rows)
        held_row, held_token = loose.located()
        assert torch.equal(held_row[-len(picked):], torch.tensor([r for r, _ in picked], dtype=torch.int32))
        assert torch.equal(held_token[-len(picked):], torch.tensor([first + t for _, t in picked], dtype=torch.int32))
    with pytest.raises(ValueError, match="start on a 32-token tile"):
        loose.tile_index(rows, 5, cpu)
    kept.select_batch(torch.tensor([1, 0, 1]), 3)  # rows 0..2 are batch 0, 3..5 batch 1
    start2, mask2 = kept.tile_index(9, 6, cpu)
    assert torch.equal(mask2[:3], mask[3:]) and torch.equal(mask2[3:6], mask[:3]) and torch.equal(mask2[6:], mask[3:])
    new_row, new_token = kept.located()
    old_of = torch.tensor([3, 4, 5, 0, 1, 2, 3, 4, 5])[new_row.long()]
    for i in range(kept.entries):  # every kept entry's values are the entry it was at its old row and token
        j = ((row_of == old_of[i]) & (token_of == new_token[i])).nonzero().item()
        assert torch.equal(kept.fields["q_packed"][i], torch.cat([a[2] for a in appended])[j])

def test_fused_generation_equals_reference_path():
    """depthweave-kv (fused) and its reference-kernel ablation store the same bytes and decode the same tokens;
    between flushes the fused path never reconstructs K/V."""
    model = tiny_llama(layers=4, hidden=256)  # head_dim 64
    torch.manual_seed(1)
    ids = torch.randint(1, 128, (2, 200))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    results = {}
    for name in ("depthweave-kv", "depthweave-kv-reference-kernel"):
        cache = build_cache(load_pipeline(name), model, tokenizer=ToyTokenizer())
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                 output_scores=True, return_dict_in_generate=True, **cache_kwargs(model, cache))
        results[name] = (out, cache)
    (fused, fused_cache), (reference, reference_cache) = results.values()
    assert fused_cache.engine.kernel.materializes is False
    assert torch.equal(fused.sequences, reference.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(fused.scores, reference.scores)) < 1e-4
    breakdown = fused_cache.memory_breakdown()
    assert breakdown["coefficients"] == reference_cache.memory_breakdown()["coefficients"]


def test_fused_decode_reads_in_place(monkeypatch):
    """Decode steps, and the compression of a block during decoding (routing included), never reconstruct
    the packed K/V with the fused kernel."""
    model = tiny_llama(layers=4, hidden=256)
    cache = build_cache(load_pipeline("depthweave-kv"), model, tokenizer=ToyTokenizer())
    ids = torch.randint(1, 128, (1, 160))
    with torch.no_grad():
        out = model(input_ids=ids, **cache_kwargs(model, cache))
        packed = cache.engine.view(0).packed_tokens
        assert packed > 0
        calls = []
        monkeypatch.setattr(cache.engine, "reconstruct", lambda *a, **k: calls.append(a))
        token = out.logits[:, -1:].argmax(-1)
        for _ in range(40):  # a block leaves the exact window after 32 steps
            token = model(input_ids=token, **cache_kwargs(model, cache)).logits[:, -1:].argmax(-1)
    assert cache.engine.view(0).packed_tokens > packed
    assert calls == []


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_routing_statistics_from_the_packed_storage_equal_the_reconstructed_ones(tmp_path, backend):
    """The router's attention mass and spike on a block, normalized by the kernel's log-sum-exp over the
    packed tokens, equal those computed over reconstructed keys."""
    cache = filled(tmp_path, 4, 2, 64, 256, name=f"dw-kernel-{backend}")
    engine = cache.engine
    assert engine.kernel.backend == backend
    members, count = engine.groups[0], 32
    mass, spike = engine._attention_stats(members, count)
    for i, layer in enumerate(members):
        stored = engine.view(layer)
        keys = torch.cat((engine.reconstruct(layer, "keys", torch.float32), stored.keys.exact.float()), dim=-2)
        expected = engine.observer.attention_stats(layer, keys, count, stored.packed_tokens)
        tolerance = 1e-5 if backend == "torch" else 2e-3  # the kernel's float16 operands
        assert torch.allclose(mass[i], expected[0], atol=tolerance, rtol=tolerance), (mass[i] - expected[0]).abs().max()
        assert torch.allclose(spike[i], expected[1], atol=tolerance, rtol=tolerance)
    assert float(mass.sum()) > 0


def test_the_kernels_folder_found_as_top_level_kernels_hands_over_to_an_installed_package():
    """Python started in the checkout's root finds kernels/ under the top-level name ``kernels``, the Hugging Face
    package's, which transformers imports where it is installed: imported so, the folder gives way to the installed
    package (where there is one), and transformers' models import from there."""
    import importlib.metadata
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    probe = "import kernels, sys; print(kernels.__file__); from transformers import LlamaForCausalLM; print('models ok')"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0, done.stderr[-2000:]
    found, models = done.stdout.strip().splitlines()[-2:]
    try:
        importlib.metadata.version("kernels")
        installed = True
    except importlib.metadata.PackageNotFoundError:
        installed = False
    assert (Path(found).resolve().parent != root / "kernels") == installed, found
    assert models == "models ok"
