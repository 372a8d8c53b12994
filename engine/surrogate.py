"""Context importance from one forward: a linear map of each layer's attention input fitted to KVzip's scores.

KVzip's scores (:mod:`kvweave.engine.importance`) cost the context's prefill plus as many tokens again fed as
repetitions over it, each attending over the whole context: on Llama-3-8B's shape at 32K tokens, 4.8 s against a
1.4 s prefill. The surrogate predicts them from what the prompt's own forward computes anyway: for each layer, the
hidden states the attention module reads (after its input norm), ``h [T, D]``, map to one log score per token and KV
head, ``s = h W_l + b_l`` (``W_l`` [D, H]). KVzap (NVIDIA's kvpress project, 2026) fits such a map to KVzip's
scores over unlabeled text and reports that it keeps most of KVzip's choice; here it is fitted by ridge regression, in closed
form, to ``log`` of the very scores :func:`~kvweave.engine.importance.reconstruction_scores` gives, so the cut of
the ``kvzip`` evictor (one threshold over the model, ``pool``, ``copying``) applies to it unchanged.

``kvweave train-scorer`` (:func:`kvweave.tools.scorer_fit.fit_surrogate`) scores windows of text with KVzip, sums each
layer's normal equations (no hidden state is kept), holds the last window out and reports how much of KVzip's kept
set the fitted map keeps there. :func:`surrogate_scores` is the scorer: one context pass into a plain cache, each layer's scores computed in a hook.
Layers KVzip cannot score whole (sliding windows) are not fitted and score ``+inf``, as with KVzip.

A weights file is a ``torch.save`` dict (``FORMAT``): ``weight`` [L, D, H] and ``bias`` [L, H] float32, ``scored``
[L] bool, ``hidden``, optionally ``induction`` [L, H] (the model's induction scores, measured at the fit: the
``copying`` threshold reads them instead of probing the model again), the held-out figures and the command that wrote
it. ``builtin:NAME`` names one shipped in
``plugins/evictors/weights/``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.core.params import shipped_path
from kvweave.engine.observation import cache_kwargs
from kvweave.engine.taps import EnergyTap, HiddenTap

FORMAT = "kvweave-kvzip-surrogate.v1"
#: where ``builtin:NAME`` weights live
SHIPPED = Path(__file__).resolve().parent.parent / "plugins" / "evictors" / "weights"
#: the smallest KVzip score taken before the log (a probability; KVzip's lowest are ~1e-6)
FLOOR = 1e-9


def load_surrogate(spec: str) -> dict[str, Any]:
    """Read and check a surrogate weights file (see the module's docstring; ``builtin:NAME`` is ``NAME.pt`` shipped)."""
    path = shipped_path(spec, SHIPPED, ".pt", "surrogate")
    if not path.is_file():
        raise ValueError(f"'weights' file {path} does not exist (write one with 'kvweave train-scorer')")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a pickle of something else, a truncated file
        raise ValueError(f"'weights' file {path} is not a kvweave surrogate ({type(exc).__name__}: {exc})") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"'weights' file {path} is not a kvweave surrogate (format {FORMAT!r})")
    weight, bias, scored = data.get("weight"), data.get("bias"), data.get("scored")
    if not (isinstance(weight, torch.Tensor) and weight.dim() == 3 and isinstance(bias, torch.Tensor)
            and tuple(bias.shape) == (weight.shape[0], weight.shape[2]) and isinstance(scored, torch.Tensor)
            and tuple(scored.shape) == (weight.shape[0],)):
        raise ValueError(f"'weights' file {path}: weight [L, D, H], bias [L, H] and scored [L] do not agree")
    if not bool(torch.isfinite(weight).all() and torch.isfinite(bias).all()):
        raise ValueError(f"'weights' file {path} holds non-finite weights")
    induction = data.get("induction")
    if induction is not None and not (isinstance(induction, torch.Tensor) and tuple(induction.shape) == (weight.shape[0], weight.shape[2])):
        raise ValueError(f"'weights' file {path}: induction scores must be [L, H] = {list(weight.shape[::2])}")
    return data


def check_surrogate(data: dict[str, Any], shape: ModelShape, where: str) -> None:
    """A ModelError naming ``where`` unless the weights were fitted for a model of ``shape``'s layers and KV heads,
    with its sliding-window layers (which KVzip cannot score whole) the ones left unscored."""
    have = (int(data["weight"].shape[0]), int(data["weight"].shape[2]))
    if have != (shape.num_layers, shape.num_kv_heads):
        raise ModelError(f"{where}: the surrogate was fitted for {have[0]} layers x {have[1]} KV heads "
                         f"(model {data.get('model', '?')}); this model has {shape.num_layers} x {shape.num_kv_heads}")
    sliding = shape.sliding_layers
    wrong = [layer for layer, on in enumerate(data["scored"].tolist()) if on == (layer in sliding)]
    if wrong:
        raise ModelError(f"{where}: layer(s) {wrong} are scored where the model keeps a sliding window, or the other way "
                         "round (fitted on another model?)")


CHUNK_ELEMENTS = 1 << 25  # 128 MiB of float32 hidden states multiplied at a time (a 32K-token prompt of width 4,096: 4 chunks)


def surrogate_scores(model: Any, input_ids: torch.Tensor, data: dict[str, Any], *, sinks: int = 4,
                     keep: list | None = None, energy: Any = None, logits: list | None = None) -> torch.Tensor:
    """Predicted log KVzip scores of ``input_ids`` [B, T]: float32 [L, B, H, T] on the model's device from one forward
    (``+inf`` for unscored layers and the first ``sinks`` positions). ``keep`` and ``energy`` as in
    :func:`~kvweave.engine.importance.reconstruction_scores`; ``keep`` receives every token of every layer, those of
    sliding-window layers too (they hold it only for this pass: ingesting keeps their windows); ``logits`` receives the
    forward's logits of the last token [B, V]."""
    from transformers import DynamicCache

    if input_ids.dim() != 2 or input_ids.shape[-1] < 1:
        raise CacheStateError(f"context scoring takes input_ids [B, T] with T >= 1, got shape {tuple(input_ids.shape)}")
    layers, hidden, heads = (int(n) for n in data["weight"].shape)
    batch, total = input_ids.shape
    device = model.device
    weight, bias, scored = data["weight"].to(device), data["bias"].to(device), data["scored"].tolist()
    scores = torch.full((layers, batch, heads, total), math.inf, dtype=torch.float32, device=device)

    def take(layer: int, states: torch.Tensor) -> None:
        if layer >= layers:
            raise ModelError(f"the surrogate was fitted for {layers} layers; the model has a layer {layer}")
        if states.shape[-1] != hidden:
            raise ModelError(f"the surrogate was fitted on hidden states of {hidden}; layer {layer} reads {states.shape[-1]}")
        if scored[layer]:
            step = max(1, CHUNK_ELEMENTS // max(1, batch * hidden))  # a float32 copy of at most CHUNK_ELEMENTS at once
            for start in range(0, total, step):
                part = states[:, start:start + step].float() @ weight[layer] + bias[layer]
                scores[layer, :, :, start:start + step] = part.transpose(1, 2)

    # kept for ingesting: every layer keeps every token (a sliding-window layer's too, as a cache's own forward feeds
    # it them); else the model's own cache, windows and all
    cache = DynamicCache() if keep is not None else DynamicCache(config=model.config)
    with torch.inference_mode(), HiddenTap(model, take), EnergyTap(model, energy, heads):
        out = model(input_ids=input_ids.to(device), use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    if keep is not None:
        keep.extend((layer.keys, layer.values) for layer in cache.layers)
    if logits is not None:
        logits.append(out.logits[:, -1])
    if sinks:
        scores[..., :sinks] = math.inf
    return scores
