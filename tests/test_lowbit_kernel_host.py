"""The ``lowbit`` kernels as built for a GPU and as called per decode step: they compile for sm_90 with the arguments
the plugin passes, hold no copy of the cache's storage, hide restored tokens by a short slot list, dispatch few torch
operations per call and make their packed views once per storage state (CPU; Triton's interpreter where a kernel runs)."""

from __future__ import annotations

import atexit
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading

import attrs
import pytest
import torch

from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine import importance
from kvweave.engine.generation import generate
from kvweave.kernels.gpu_build import launch_job
from kvweave.kernels.lowbit_decode import plan_combine, plan_launch

from conftest import CharTokenizer, tiny_llama
from test_lowbit_kernel import model, registry  # noqa: F401 - the same storages and model


COMPILE = """
import importlib, json, sys, traceback
from kvweave.kernels.gpu_build import build
for line in sys.stdin:  # one job a line, built in turn; each answer one line after its marker
    job = json.loads(line)
    try:
        compiled = build(importlib.import_module(job["module"]), job)
        ptx = compiled.asm["ptx"]
        answer = {"cubin": len(compiled.asm["cubin"]), "ptx": ptx.count("\\n"), "ptx_text": ptx,
                  "shared": compiled.metadata.shared}
    except Exception:
        answer = {"error": traceback.format_exc()}
    print("\\0compiled", json.dumps(answer), flush=True)
"""

#: the compiling processes (:data:`COMPILE`) started, by the environment and folder they were started in
_COMPILERS: dict[tuple, subprocess.Popen] = {}


def _compiler(env: dict) -> subprocess.Popen:
    """The process that builds jobs for sm_90 in ``env`` and this folder, started once (a process a job spent most of
    its time starting Python, Triton and its CUDA backend); one whose environment differs gets its own."""
    key = (tuple(sorted(env.items())), os.getcwd())
    process = _COMPILERS.get(key)
    if process is None or process.poll() is not None:
        stderr = tempfile.TemporaryFile(mode="w+")
        process = subprocess.Popen([sys.executable, "-c", COMPILE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=stderr, text=True, env=env)
        process.stderr_file = stderr  # type: ignore[attr-defined]
        _COMPILERS[key] = process
    return process


@atexit.register
def _stop_compilers() -> None:
    for process in _COMPILERS.values():
        try:
            process.stdin.close()
            process.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            process.kill()


def compile_job(job: dict) -> dict:
    """``job`` (:func:`kvweave.kernels.gpu_build.launch_job`) compiled for an H100/H200 (sm_90) outside the
    interpreter (in a process of its own, without ``TRITON_INTERPRET``, which builds the jobs given it in turn): the
    cubin's size, the PTX's lines and its text, the shared memory a program takes (bytes)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTEST_CURRENT_TEST")}
    process = _compiler(env)
    process.stdin.write(json.dumps(job) + "\n")
    process.stdin.flush()
    answers: queue.Queue = queue.Queue()

    def read() -> None:
        for line in process.stdout:
            if line.startswith("\0compiled "):
                answers.put(json.loads(line.split(" ", 1)[1]))
                return
        answers.put({"error": "the compiling process ended"})

    threading.Thread(target=read, daemon=True).start()
    try:
        answer = answers.get(timeout=600)
    except queue.Empty:
        process.kill()
        answer = {"error": "no build in 600 s"}
    if "error" in answer:
        process.stderr_file.seek(0)  # type: ignore[attr-defined]
        details = answer["error"] + process.stderr_file.read()  # type: ignore[attr-defined]
        raise AssertionError(f"{job['kernel']} does not compile for sm_90:\n{details[-3000:]}")
    return answer


#: the shared memory (bytes) a block may take on an H100 or H200 (Triton's "Hardware limit" there)
SHARED_LIMIT = 232448


def compile_for_gpu(launch) -> dict:
    """Compile ``launch``'s kernel for an H100/H200 (sm_90) as the GPU would, with its argument types and constants."""
    return compile_job(launch_job(launch.kernel, launch.args, launch.constants))


def _nvidia_backend() -> bool:
    try:
        from triton.backends import backends
    except ImportError:
        return False
    return "nvidia" in backends


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
@pytest.mark.parametrize("name, variants, hidden", [
    ("prerope-k4v2-lowbit", ("wide", "general"), 64),  # 4-bit keys with an outlier, 2-bit values
    ("t-lowbit-k2v4", ("wide",), 512),  # 2-bit keys at head_dim 128
    ("t-lowbit-alloc", ("general", "wide"), 64),  # channel-alloc widths
    ("t-lowbit-log8", ("general", "wide"), 64),  # one-byte value scales
    ("t-lowbit-k3v3", ("wide",), 64),  # 3-bit keys and values, codes across bytes
    ("t-lowbit-kvzip", ("auto",), 64),  # slots at their cache indices
    ("t-lowbit-sinks", ("auto",), 64),  # tokens restored by residuals, merged by the combine
    ("t-lowbit-post", ("dense",), 64),  # keys stored after RoPE read as 32-bit words
    ("prerope-k4v2-lowbit", ("wide", "general"), 1024),  # head_dim 256
    ("t-lowbit-post", ("dense",), 1024),  # head_dim 256, four value groups
])
def test_each_kernel_compiles_for_the_gpu_with_the_arguments_the_plugin_passes(model, registry, name, variants, hidden):
    """Under the interpreter a kernel runs as Python, which accepts what the GPU compiler refuses (a constexpr
    assigned twice once broke a kernel on the GPU only): each variant is compiled for sm_90 from the
    argument types and constants of a real launch, with the bfloat16 tile operands the GPU takes; each build within the
    227 KiB of shared memory an H100 or H200 gives a block (a build past it compiles, then cannot launch: the packing
    kernels at head_dim 256 did, tests/test_pack_kernels.py)."""
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    model = model if hidden == 64 else tiny_llama(layers=2, hidden=hidden)
    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, ids[:1] if importance.needs_importance(cache) else ids)  # kvzip scores whole rows
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    rows = view.exact_k.shape[0]
    q = torch.randn(rows, 4, view.exact_k.shape[-1])
    for variant in variants:
        start = torch.tensor([40, 0][:rows], dtype=torch.int32)
        launch = plan_launch(view, q, start, 0.125, block=16 if variant == "general" else None, variant=variant, lowp=True)
        combines = [plan_combine(view, q, start, 0.125, launch, out_dtype) for out_dtype in (None, torch.bfloat16)]
        for planned in (launch, *combines):  # the packed pass, then the combine (float32 out, the model's bfloat16)
            stats = compile_for_gpu(planned)
            assert stats["cubin"] > 0 and stats["ptx"] > 100, (variant, stats)
            assert stats["shared"] <= SHARED_LIMIT, (variant, planned.kernel, stats["shared"])


def _held_bytes(item) -> int:
    if isinstance(item, torch.Tensor):
        return item.nbytes
    if isinstance(item, dict):
        return sum(_held_bytes(v) for v in item.values())
    if isinstance(item, (tuple, list)):
        return sum(_held_bytes(v) for v in item)
    return 0


@pytest.mark.parametrize("name", ["t-lowbit-kvzip", "t-lowbit-sinks"])
def test_the_kernel_holds_no_copy_of_what_the_cache_stores(model, registry, name):
    """What the cache reports is what it holds: the kernel reads channel-alloc widths and slot positions as stored,
    so the state it keeps between calls (constant tables, the few restored sink tokens) does not grow with the
    context (it once kept int32 widths, offsets and positions per layer, uncounted)."""
    held = []
    for length in (200, 400):
        ids = torch.randint(1, 128, (1, length), generator=torch.Generator().manual_seed(6))
        cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
        generate(model, {"input_ids": ids}, cache, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert cache.engine.windows[1].compressed_tokens >= length // 2 - 64  # the kernel read packed tokens
        held.append(_held_bytes(cache.engine.kernel_state))
    assert held[0] == held[1] > 0, held


def test_restored_tokens_are_hidden_by_a_short_slot_list_not_a_position_per_slot(model, registry):
    """A cache that restores its sinks but drops nothing is read in slot order: the few restored slots are listed
    per row (a power of two wide), and no position per packed slot is built at every call (it once was: a [B x H,
    T] tensor per layer and step)."""
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.positions is None and view.restored_k is not None
    hidden = view.hidden_slots
    assert hidden.dtype == torch.int32 and hidden.shape == (4, 4)  # 2 rows x 2 KV heads, the 4 sinks
    assert sorted(hidden[0].tolist()) == [0, 1, 2, 3]


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_a_decode_call_dispatches_few_torch_operations(model, registry, monkeypatch):
    """Each torch operation a decode call dispatches costs host time on a GPU (the step at B = 1 is host-bound):
    the splits are combined, rotated back and merged with the exact window and the restored tokens by one Triton
    program per query head, so a call is two launches and a handful of allocations (it was 58 operations)."""
    from torch.profiler import ProfilerActivity, profile

    from kvweave.kernels import lowbit_decode as module

    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    assert view.restored_k is not None  # the merge has restored tokens to attend too
    for name in ("plan_launch", "plan_combine"):  # what the host does, without running the kernels
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: attrs.evolve(real(*a, **k), kernel=_NoLaunch()))
    q = torch.randn(2, 4, 64)
    start = torch.tensor([40, 0], dtype=torch.int32)
    module.lowbit_decode(view, q, start, 0.125)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        module.lowbit_decode(view, q, start, 0.125)
    dispatched = [e.name for e in prof.events() if e.name.startswith("aten::")
                  and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::"))]
    assert len(dispatched) <= 12, dispatched


def test_the_packed_views_are_made_once_per_storage_state(model, registry):
    """A decode step asks every layer for its view: the packed storage's views are kept until a flush changes the
    storage (no torch operation on a repeated call), and a view after a flush equals one built from scratch."""
    from torch.profiler import ProfilerActivity, profile

    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    kernel, cpu = cache.engine.kernel, torch.device("cpu")
    first = kernel.lowbit_view(cache.engine.view(1), cpu)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        again = kernel.lowbit_view(cache.engine.view(1), cpu)
    assert not [e.name for e in prof.events() if e.name.startswith("aten::")]
    assert again.k_codes is first.k_codes and again.restored_k is first.restored_k
    with torch.no_grad():  # enough tokens for the next block to flush
        model(input_ids=ids[:, :80], use_cache=True, **cache_kwargs(model, cache))
    later = kernel.lowbit_view(cache.engine.view(1), cpu)
    assert later.tokens > first.tokens
    view = cache.engine.view(1)
    view.scratch.clear()
    fresh = kernel.lowbit_view(view, cpu)
    for field in attrs.fields(type(fresh)):
        a, b = getattr(later, field.name), getattr(fresh, field.name)
        assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name


@pytest.mark.interpreter
def test_kept_query_rows_and_an_output_in_the_models_dtype_give_what_per_call_rows_and_a_conversion_give(model, registry):  # noqa: F811
    """The plugin keeps the zero-padded query rows across layers and steps (one copy a call instead of a fill, a
    conversion and a copy): a buffer reused for another query gives what fresh rows give; a buffer of another shape
    is refused. The combine rounds to the model's dtype as ``.to`` would."""
    from kvweave.kernels.lowbit_decode import lowbit_decode, resolve_variant
    from kvweave.plugins.kernels.lowbit import _query_rows

    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    view = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    scratch: dict = {}
    variant = resolve_variant(view, "auto")[0]  # keys before RoPE: the wide kernel, whose tiles are 16 rows
    rows = _query_rows(scratch, 4, torch.zeros(2, 4, 64), variant)  # 2 rows x 2 KV heads, 2 query heads each
    assert variant == "wide" and rows.shape == (4, 16, 64) and _query_rows(scratch, 4, torch.ones(2, 4, 64), variant) is rows
    assert _query_rows({}, 4, torch.zeros(2, 4, 64), "dense").shape == (4, 8, 64)  # the dense kernel's 8 rows
    for seed in (0, 1):
        q = torch.randn(2, 4, 64, generator=torch.Generator().manual_seed(seed))
        kept = lowbit_decode(view, q, None, 0.125, query_rows=rows)
        assert torch.equal(kept, lowbit_decode(view, q, None, 0.125))
        assert torch.equal(rows[:, 2:], torch.zeros_like(rows[:, 2:]))  # the padding stays zero
    with pytest.raises(ValueError, match="query rows must be float32"):
        lowbit_decode(view, q, None, 0.125, query_rows=torch.zeros(4, 8, 64))
    # the combine writes the model's dtype itself (no conversion launched a call), rounded as torch rounds
    for dtype in (torch.bfloat16, torch.float16):
        rounded = lowbit_decode(view, q, None, 0.125, out_dtype=dtype)
        assert rounded.dtype == dtype and torch.equal(rounded, lowbit_decode(view, q, None, 0.125).to(dtype))


@pytest.mark.parametrize("name", ["t-lowbit-kvzip-cg", "t-lowbit-kvzip"])
def test_a_block_flushed_while_the_kernel_decodes_is_evicted_with_the_masks_of_the_decoded_tokens(model, registry, name):
    """The context prefilled apart, the question fed with the model's mask over the prompt, then decoded by the kernel
    (which reads the packed storage in place, past the mask-building attention path): a block that holds decoded
    tokens is flushed and evicted during decoding. The evictor's record of which tokens are real must cover them
    (it was left at the prompt's mask, and the flush failed with 'the attention mask covers 100 tokens, but the cache
    holds token 127', as a 30-needle grid found on SmolLM2 with a prompt of 1,849 tokens)."""
    ids = torch.randint(1, 128, (1, 100), generator=torch.Generator().manual_seed(9))
    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    with torch.no_grad():
        importance.prefill(model, cache, ids[:, :90])  # the context, scored and compressed before the question
    new, _ = generate(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache, max_new_tokens=60,
                      min_new_tokens=60, do_sample=False, pad_token_id=0)
    assert new.shape[-1] == 60 and cache.get_seq_length() == 100 + 60 - 1
    assert cache.engine.windows[1].passed_tokens >= 128  # the block of tokens 64..127 (28 of them decoded) was flushed


@pytest.mark.parametrize("name", ["t-lowbit-sinks-kvzip", "t-lowbit-sinks-cg"])
def test_restored_vectors_are_dequantized_span_by_span(model, registry, name, monkeypatch):
    """The vectors of the tokens that residuals restore are dequantized from the spans that hold them, not from the
    whole layer (that temporary once took ~0.9 GB per 64K-token row on Llama-3-8B's shape and capped the batch), and
    equal the whole layer's dequantization at those slots: channel-alloc widths, outliers, one-byte value scales and
    slot positions sliced alike."""
    from kvweave.kernels import lowbit_decode
    from kvweave.plugins.kernels import lowbit

    cache = build_cache(registry.resolve(name), model, tokenizer=CharTokenizer())
    ids = torch.randint(1, 128, (2, 600), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        importance.prefill(model, cache, ids)
    packed = cache.engine.kernel.lowbit_view(cache.engine.view(1), torch.device("cpu"))
    rows = packed.k_codes.shape[0]
    assert packed.tokens >= 256 and packed.restored_k is not None
    flat = torch.unique(torch.randint(0, rows * packed.tokens, (40,), generator=torch.Generator().manual_seed(1)))
    dim = packed.exact_k.shape[-1]
    want_k = lowbit_decode.torch_keys(packed).reshape(-1, dim)[flat]
    want_v = (lowbit_decode.torch_values(packed) @ packed.rotation).reshape(-1, dim)[flat]
    seen = []
    whole = lowbit.torch_keys
    monkeypatch.setattr(lowbit, "torch_keys", lambda view: seen.append(view.tokens) or whole(view))
    monkeypatch.setattr(lowbit, "RESTORE_SPAN", 64)
    keys, values = lowbit._dequantized_at(packed, flat)
    assert seen and max(seen) <= 64 < packed.tokens
    assert torch.allclose(keys, want_k, atol=1e-5) and torch.allclose(values, want_v, atol=1e-5)


def test_a_flush_drops_the_views_of_the_storage_it_replaced(model, registry):
    """The packed views a layer keeps between steps are views of its stored tensors; a flush stores them anew, and the
    views of the old ones must go with it, or every layer holds its old storage as well until its next step (a second
    copy of the whole cache at each flush: on Llama-3-8B's shape at 64K, 7.2 GB more at B = 8)."""
    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    ids = torch.randint(1, 128, (2, 300), generator=torch.Generator().manual_seed(3))
    cpu, flushes = torch.device("cpu"), 0
    with torch.no_grad():
        model(input_ids=ids[:, :230], use_cache=True, **cache_kwargs(model, cache))
        for step in range(230, 300):
            before = cache.engine.windows[1].compressed_tokens
            model(input_ids=ids[:, step : step + 1], use_cache=True, **cache_kwargs(model, cache))
            flushes += cache.engine.windows[1].compressed_tokens > before
            for key, (_, kept) in [(k, v) for k, v in cache.engine.kernel_state.items() if k[0] == "lowbit-view"]:
                stored = cache.engine.view(key[1]).keys.coefficients["codes"]
                assert kept.k_codes.untyped_storage().data_ptr() == stored.untyped_storage().data_ptr(), (step, key)
    assert flushes >= 1 and cache.engine.kernel_state  # blocks were flushed while views were kept


def test_the_model_leaves_the_splits_to_the_launch(model, registry, monkeypatch):
    """The layer call asks for no number of programs: the launch chooses (the dense kernel by its waves,
    ``dense_splits``; the others aim for 528 programs, or at least four splits a row where the rows alone fill more)."""
    from kvweave.kernels.launch import default_programs
    from kvweave.plugins.kernels import lowbit

    assert default_programs(16) == 528 and default_programs(1024) == 4096
    cache = build_cache(registry.resolve("t-lowbit-sinks"), model)
    ids = torch.randint(1, 128, (2, 230), generator=torch.Generator().manual_seed(2))
    asked = []
    monkeypatch.setattr(lowbit, "lowbit_decode", lambda *a, **k: asked.append(k["programs"]) or lowbit.torch_lowbit_decode(*a[:4]))
    cache.engine.kernel = attrs.evolve(cache.engine.kernel, backend="triton")
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        model(input_ids=ids[:, :1], use_cache=True, **cache_kwargs(model, cache))
    assert asked and set(asked) == {None}
