"""Where time-to-first-token goes with a compressing cache: the prompt's forward, split by compression stage.

    python benchmarks/profile_prefill.py [--tokens 32768] [--pipeline depthweave-kv] [--registry FILE] [--layers 32] [--smoke] [--ops N]

Runs ``model.generate(max_new_tokens=1)`` on a Llama-3-8B-shaped model with random bf16 weights (the
shape of ``decode_e2e.py``) for one prompt of random token ids, once to warm up and once measured. The
measured run times each compression stage (the engine's calls into its components and its own steps,
synchronized before and after, so the stages add up to the device's time in them) and prints a table:
stage, calls, total seconds, share of the time to first token. The rest is the model's forward
(projections, MLPs, prefill attention) and whatever the stages do not cover. Also runs the full cache
(DynamicCache) for the same prompt as the baseline. A pipeline whose evictor scores the context first (``kvzip``)
is scored as ``kvweave generate`` scores it, before the prompt's forward, and the scoring is timed as its own stages
(``importance.reconstruction_scores``: the repetition forwards; ``importance.copying_layers``: the induction probe; ``importance.surrogate_scores``: a surrogate scorer's one forward; ``importance.ingest_context``: the scoring pass's keys and values stored through the cache's flushes, after it and outside any forward).
``--ops N``: one more run under the torch profiler, then each stage's own device time (its operations' kernels,
not its nested stages') and the N torch operations that took the most, each charged to the innermost stage it ran
in (``forward`` outside every stage): where inside a stage its time goes. ``--smoke``: a tiny model of the same head shape on the CPU (checks the script).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import time
from collections import defaultdict

import torch
from transformers import DynamicCache

import kvweave.engine.encoder as encoder_module
import kvweave.engine.engine as engine_module
import kvweave.engine.flushing as flushing_module
import kvweave.engine.importance as importance_module
import kvweave.engine.ingest as ingest_module
import kvweave.engine.together as together_module
from kvweave.engine import build_cache
from kvweave.core.registry import load_pipeline
from kvweave.engine.residuals import ResidualFit, ResidualList

import decode_e2e
from decode_e2e import Ids, llama3_8b, random_model, smoke_config, sync

TOTALS: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
STAGE = "stage:"  # the profiler's name for a timed stage's range


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        sync()
        start = time.perf_counter()
        try:
            with torch.profiler.record_function(STAGE + name):
                return fn(*args, **kwargs)
        finally:
            sync()
            TOTALS[name][0] += 1
            TOTALS[name][1] += time.perf_counter() - start
    return wrapper


def instrument(cache, patch=setattr) -> None:
    """Wrap the compression stages of ``cache``'s engine with synchronized timers: the methods of its
    components' classes (components are frozen; the script's last run is the measured one) and the
    engine's own steps. ``patch`` sets each wrapper (a test passes ``monkeypatch.setattr``, which takes them off)."""
    engine = cache.engine
    classes = [(f"basis.{m}", type(engine.basis), m) for m in ("init_state", "encode", "decode")]
    classes.append(("router.assign", type(engine.router), "assign"))
    quantizers = {type(engine.quantizers[kind]) for kind in ("keys", "values")}
    classes += [(f"quantizer.{m}", cls, m) for cls in quantizers for m in ("quantize", "dequantize")]
    classes += [(f"engine.{m}", type(engine), m) for m in ("_flush", "_attention_stats")]
    classes += [(f"encoder.{m}", type(engine.encoder), m) for m in ("encode", "probe", "route_block", "rank_counts", "encode_members")]
    classes.append(("probe.measure", type(engine.probe), "measure"))
    classes.append(("residuals.ResidualList.append", ResidualList, "append"))
    classes.append(("residuals.ResidualFit.basis", ResidualFit, "basis"))  # a residual basis fit's end (and any fallback)
    if engine.evicts:  # an evictor's flush: its choice, the slots topped up to whole groups, the kept tokens gathered
        classes.append(("evictor.keep", type(engine.evictor), "keep"))
        classes += [(f"eviction.{m}", type(engine.eviction), m) for m in ("evict", "_eviction_block", "_whole_groups", "_kept_index", "_gather_tokens")]
    for name, cls, method in classes:
        if hasattr(cls, method):
            wrapped = timed(name, getattr(cls, method))
            patch(cls, method, staticmethod(wrapped) if isinstance(inspect.getattr_static(cls, method), staticmethod) else wrapped)


def patch_module(patch=setattr) -> None:
    patch(flushing_module, "check_finite", timed("checks.check_finite", flushing_module.check_finite))
    patch(together_module, "check_finite", timed("checks.check_finite", together_module.check_finite))  # flushes stored together
    for name in ("begin_residual_fit", "encode_residuals", "add_residuals", "residual_rows", "mix_residuals"):
        for module in (engine_module, encoder_module):  # wherever the engine's steps call them from
            if hasattr(module, name):
                patch(module, name, timed(f"residuals.{name}", getattr(module, name)))
    patch(ingest_module, "flush_together", timed("together.flush_together", ingest_module.flush_together))  # an ingest's flushes
    for name in ("reconstruction_scores", "surrogate_scores", "copying_layers", "ingest_context"):  # context scoring (kvzip) and its storing, called by score_for
        patch(importance_module, name, timed(f"importance.{name}", getattr(importance_module, name)))


def first_token(model, cache, ids) -> float:
    sync()
    start = time.perf_counter()
    decode_e2e.first_token(model, cache, ids)  # the scoring pass's first token where the cache scores its prompt
    sync()
    return time.perf_counter() - start


def stage_of(event) -> str:
    """The innermost timed stage around a profiler event (``forward`` where none is)."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(STAGE):
            return parent.name[len(STAGE):]
        parent = parent.cpu_parent
    return "forward"


def op_table(model, cache, ids, top: int) -> list[tuple[str, str, int, float]]:
    """(stage, operation, calls, device seconds) of the ``top`` operations by device time in one profiled first
    token, each operation's own kernels charged to the innermost stage it ran in."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if ids.is_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        first_token(model, cache, ids)
    rows: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU:  # a kernel: charged to the operation that launched it
            continue
        own = event.self_device_time_total if ids.is_cuda else event.self_cpu_time_total
        if own <= 0 or event.name.startswith(STAGE):
            continue
        row = rows[(stage_of(event), event.name)]
        row[0] += 1
        row[1] += own / 1e6
    stages: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for (stage, _), (calls, seconds) in rows.items():
        stages[stage][0] += calls
        stages[stage][1] += seconds
    ranked = sorted(rows.items(), key=lambda item: -item[1][1])[:top]
    totals = [(stage, "(every operation)", int(calls), seconds) for stage, (calls, seconds) in sorted(stages.items(), key=lambda item: -item[1][1])]
    return totals + [(stage, name, int(calls), seconds) for (stage, name), (calls, seconds) in ranked]


def main(patch=setattr) -> None:
    """The command line's run; ``patch`` sets the stages' timers (see :func:`instrument`)."""
    TOTALS.clear()  # a second run in one process times its own stages only
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--pipeline", default="depthweave-kv")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="a tiny model of the same head shape on the CPU (checks the script)")
    parser.add_argument("--ops", type=int, default=0, help="one more run under the torch profiler: the N operations with the most device time, by stage")
    parser.add_argument("--registry", help="a user registry file read on top of the built-in one (e.g. benchmarks/dense_sweep.toml)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model = random_model(smoke_config(args.layers) if args.smoke else llama3_8b(args.layers), device)
    ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device=device)
    fresh = lambda: build_cache(load_pipeline(args.pipeline, args.registry), model, tokenizer=Ids(model.config.vocab_size))  # noqa: E731
    model.set_attn_implementation("sdpa")
    first_token(model, DynamicCache(config=model.config), ids)
    full = first_token(model, DynamicCache(config=model.config), ids)
    first_token(model, fresh(), ids)  # warm-up (kernels compiled, allocator grown)
    plain = first_token(model, fresh(), ids)
    cache = fresh()
    instrument(cache, patch)
    patch_module(patch)
    total = first_token(model, cache, ids)
    print(f"prompt {args.tokens} tokens, {args.layers} layers, {device}: full cache {full:.3f} s, {args.pipeline} "
          f"{plain:.3f} s (uninstrumented), {total:.3f} s instrumented; stored {cache.compression_ratio():.2f}x smaller")
    print("| stage | calls | seconds | share of TTFT |")
    print("|---|---|---|---|")
    for name, (calls, seconds) in sorted(TOTALS.items(), key=lambda item: -item[1][1]):
        print(f"| {name} | {calls} | {seconds:.3f} | {seconds / total:.0%} |")
    print("(stages nest: engine._flush, or together.flush_together where an ingest's flushes go together, contains the "
          "others; importance.* run before the prompt's forward; the model's forward is TTFT minus engine._flush and "
          "importance.*)")
    if args.ops:
        unit = "device" if ids.is_cuda else "CPU"
        print(f"\n| stage | operation | calls | {unit} seconds (own kernels) |")
        print("|---|---|---|---|")
        for stage, name, calls, seconds in op_table(model, fresh(), ids, args.ops):
            print(f"| {stage} | {name} | {calls} | {seconds:.4f} |")


if __name__ == "__main__":
    main()
