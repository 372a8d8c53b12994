"""``kvzip``: the tokens a model needs to repeat its context, kept; the others dropped, before any question.

Kim, Kim, Kwon, Lee, Yun, Song: "KVzip: Query-Agnostic KV Cache Compression with Context Reconstruction"
(NeurIPS 2025, arXiv:2505.23416). The context is scored first (``kvweave.engine.importance``: the model
is asked to repeat it, and each cached token scores the largest attention a repetition query gives it);
then the forward that fills the cache keeps, of the scored tokens, the ``fraction`` that score highest:

* ``share = "model"`` (the paper's default): one threshold over every layer and KV head, so layers the
  model reads more keep more; each layer then keeps the same count in each of its KV heads (the count its
  heads' tokens above the threshold average to), so a layer's heads store equal numbers of slots.
* ``share = "layer"``: every layer keeps ``fraction`` of its scored tokens in each KV head.

``spread = "segments"`` (not in the paper) keeps a layer's share in every ``segment`` positions instead of
above one cut per layer and head: reconstruction scores favour the end of a context (docs/frontier.md), so
one cut leaves the beginning nearly empty.

``keep_layers`` (not in the paper) names layers that keep every token; ``fraction`` is then the share kept of the
other layers' scored tokens. The layers to name are the model's copying layers, whose induction heads carry a
needle's digits to the answer (``python benchmarks/induction_heads.py`` lists them; on SmolLM2-135M, layers 17, 18,
20 and 23): one cut over the model drops a third to a half of a needle's digit entries in some of those heads.
``copying = t`` (0 < t <= 1) finds them itself: every layer with a KV head whose induction score is at least ``t``
keeps every token (``kvweave.engine.copying``: one forward of random tokens repeated twice, once per model, when
the first context is scored); on SmolLM2-135M ``copying = 0.3`` gives the four layers above.

The first ``sinks`` tokens are always kept (and not counted against the threshold), as are tokens the
scorer cannot see whole (the sliding-window layers of Gemma 3, whose own window bounds them) and every
token fed after the scored forward (the question, generated tokens). Scoring costs about two extra
prefills of the context, split in ``chunk``-token pieces.

``scorer = "surrogate"`` (not in the paper; KVzap's idea) predicts the scores instead, from the attention inputs of
the prompt's own forward, by a linear map per layer fitted to KVzip's scores with ``kvweave train-scorer``
(``weights``; ``kvweave.engine.surrogate``): no repetition is fed, so scoring costs one prefill, which the cache
takes as its own (docs/frontier.md "Scores without the repetition").
"""

from __future__ import annotations

import math
from typing import ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.errors import ModelError
from kvweave.core.evictor import EvictionBlock, Evictor
from kvweave.core.interfaces import ModelShape
from kvweave.core.lazy import torch
from kvweave.core.params import choice, int_tuple, integer


#: each scores tensor's cuts for every layer, by (evictor, window): made at the first layer's flush, gone with the scores
_CUTS: dict | None = None


def _layer_list(_instance, attribute, value) -> None:
    if not isinstance(value, tuple) or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ValueError(f"'{attribute.name}' must be a list of layer indices (integers >= 0), got {value!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"'{attribute.name}' names a layer twice: {list(value)}")


def _copying(_instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"'{attribute.name}' must be a number in [0, 1] (an induction score; 0: off), got {value!r}")


def _fraction(_instance, attribute, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"'{attribute.name}' must be a number in (0, 1], got {value!r}")


@attrs.frozen
class KVzipEvictor(Evictor):
    """Keeps the scored context's most important tokens by reconstruction attention (KVzip)."""

    head_sharding: ClassVar[str] = "head-local"
    needs_importance: ClassVar[bool] = True
    layer_local: ClassVar[bool] = True  # each layer's cut is its own (taken from the whole model's scores)
    reads_keys: ClassVar[bool] = False  # the context's scores only

    fraction: float = attrs.field(default=0.5, validator=_fraction,
                                  metadata={"doc": "share of the scored context's tokens kept (per layer and KV head on average)"})
    share: str = attrs.field(default="model", validator=choice(("model", "layer")),
                             metadata={"doc": "'model': one threshold over all layers and heads (layers keep different counts); 'layer': each layer keeps fraction"})
    sinks: int = attrs.field(default=4, validator=integer(0, 4096), metadata={"doc": "first tokens always kept (attention sinks)"})
    chunk: int = attrs.field(default=2048, validator=integer(16, 1 << 20),
                             metadata={"doc": "context tokens repeated per scoring forward"})
    spread: str = attrs.field(default="none", validator=choice(("none", "segments")),
                              metadata={"doc": "'none': one cut per layer and head; 'segments': each segment of positions keeps the layer's share"})
    segment: int = attrs.field(default=128, validator=integer(1, 1 << 20), metadata={"doc": "positions per segment (spread = 'segments')"})
    pool: int = attrs.field(default=1, validator=integer(1, 255),
                            metadata={"doc": "odd: each token scores the largest score within pool // 2 positions of it (1: its own)"})
    keep_layers: tuple[int, ...] = attrs.field(default=(), converter=int_tuple, validator=_layer_list,
                                               metadata={"doc": "layers that keep every token (fraction: of the other layers' tokens)"})
    copying: float = attrs.field(default=0.0, validator=_copying,
                                 metadata={"doc": "0: off; else layers with a KV head of at least this induction score keep every token"})
    scorer: str = attrs.field(default="reconstruction", validator=choice(("reconstruction", "surrogate")),
                              metadata={"doc": "'reconstruction': KVzip's repetition forwards; 'surrogate': a fitted map of the prompt's own forward ('weights')"})
    weights: str = attrs.field(default="", metadata={"doc": "scorer = 'surrogate': a file from 'kvweave train-scorer', or builtin:NAME"})
    _surrogate: dict | None = attrs.field(init=False, default=None, repr=False, eq=False)

    def __attrs_post_init__(self) -> None:
        if self.pool % 2 == 0:
            raise ValueError(f"'pool' must be odd (a window centred on the token), got {self.pool}")
        if not isinstance(self.weights, str):
            raise TypeError(f"'weights' must be a path (a string), got {self.weights!r}")
        if self.scorer == "surrogate" and not self.weights:
            raise ValueError("scorer = 'surrogate' needs 'weights' (a file from 'kvweave train-scorer', or builtin:NAME)")
        if self.scorer != "surrogate" and self.weights:
            raise ValueError(f"'weights' is read by scorer = 'surrogate' only; this evictor's scorer is '{self.scorer}'")
        if self.weights:
            from kvweave.engine.surrogate import load_surrogate

            object.__setattr__(self, "_surrogate", load_surrogate(self.weights))

    @property
    def surrogate(self) -> dict | None:
        """The surrogate's weights (scorer = 'surrogate'), else None."""
        return self._surrogate

    def name(self) -> str:
        return "kvzip"

    def check_model(self, shape: ModelShape) -> None:
        beyond = [layer for layer in self.keep_layers if layer >= shape.num_layers]
        if beyond:
            raise ModelError(f"evictor 'kvzip': keep_layers names layer(s) {beyond}, and the model has {shape.num_layers} "
                             f"layers (0 to {shape.num_layers - 1})")
        if self._surrogate is not None:
            from kvweave.engine.surrogate import check_surrogate

            check_surrogate(self._surrogate, shape, f"evictor 'kvzip' weights {self.weights}")

    def prepare_importance(self, scores: torch.Tensor) -> torch.Tensor:
        """The first ``sinks`` positions at ``+inf`` (kept whatever scored them: KVzip's scorer does so itself, random or
        outside scores need it too); ``pool`` > 1: each scored token takes the largest finite score of its ``pool``
        neighbourhood in its layer and head (SnapKV's clustering, applied to reconstruction scores), so a kept token
        keeps its neighbours' chance; ``+inf`` entries stay as they are and lend nothing."""
        if self.sinks and not bool(torch.isposinf(scores[..., : self.sinks]).all()):  # KVzip's scorer set them already
            scores = scores.clone()  # the caller's scores left as they were
            scores[..., : self.sinks] = math.inf
        if self.pool == 1:
            return scores
        infinite = torch.isinf(scores)
        finite = scores.masked_fill(infinite, -math.inf)
        shape = finite.shape
        pooled = torch.nn.functional.max_pool1d(finite.reshape(-1, 1, shape[-1]), self.pool, stride=1, padding=self.pool // 2)
        return torch.where(infinite, scores, pooled.reshape(shape))

    def kept_leading(self) -> int:
        """The first ``sinks`` positions: their importance is ``+inf`` (:meth:`prepare_importance`), which passes any cut."""
        return self.sinks

    def keep(self, block: EvictionBlock) -> torch.Tensor:
        if block.importance is None:
            raise ValueError(
                f"evictor '{self.name()}' chooses tokens by context importance, and this cache was filled without it: feed the "
                "context with kvweave.engine.importance.prefill(model, cache, input_ids) (kvweave generate and kvweave eval do)"
            )
        if block.context_importance is None:
            return torch.ones_like(block.importance, dtype=torch.bool)
        # no host read here: a block scored +inf throughout (sinks, a copying layer) passes any cut, +inf included
        layers = list(block.layers)
        cuts = self._every_cut(block.context_importance, block.window_tokens)[layers].to(block.importance.device)
        if self.spread == "segments":  # the cut of each token's segment of positions
            at = block.positions.clamp(0, cuts.shape[-1] - 1).long()
            return block.importance >= cuts.gather(-1, at)
        return block.importance >= cuts[..., None]  # cuts [G, B, H]

    def _every_cut(self, scores: torch.Tensor, window: int) -> torch.Tensor:
        """Every layer's cuts (:meth:`cuts`, or :meth:`segment_cuts`) over ``scores``, made once for the forward those
        scores serve: each layer's flush takes its own from them, where ranking the whole model's scores again for
        each layer cost a threshold a layer (on Llama-3-8B's shape at 32K tokens, 8.4M scores each time)."""
        global _CUTS
        if _CUTS is None:  # by the tensor's identity (torch imported lazily)
            from torch.utils.weak import WeakTensorKeyDictionary

            _CUTS = WeakTensorKeyDictionary()
        memo = _CUTS.setdefault(scores, {})
        key = (self, window)
        if key not in memo:
            memo[key] = self.segment_cuts(scores, window) if self.spread == "segments" else self.cuts(scores, window)
        return memo[key]

    def _scored(self, scores: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Which scores count (finite, not in the exact window after the scored forward) [L, B, H, T], how many
        tokens each layer's heads score [L, B], and how many each keeps [L, B] (``share``)."""
        layers, batch, heads, total = scores.shape
        finite = torch.isfinite(scores)
        if window > 0:
            finite[..., max(0, total - window):] = False
        if self.keep_layers:  # counted nowhere, cut at -inf: every token kept
            finite[list(self.keep_layers)] = False
        counts = finite[:, :, 0].sum(-1)  # [L, B] scored tokens per head of each layer
        if self.share == "layer":
            return finite, counts, torch.ceil(counts.double() * self.fraction).long()
        kept = torch.zeros_like(counts)
        for row in range(batch):
            values = scores[:, row][finite[:, row]]
            if values.numel() == 0:
                continue
            threshold = values.topk(max(1, math.ceil(self.fraction * values.numel()))).values[-1]
            above = ((scores[:, row] >= threshold) & finite[:, row]).sum(dim=(-1, -2))  # [L]
            kept[:, row] = torch.ceil(above.double() / heads).long()
        return finite, counts, kept.clamp(max=counts)

    @staticmethod
    def _select(scored: tuple[torch.Tensor, ...], layers: list[int] | None) -> tuple[torch.Tensor, ...]:
        return scored if layers is None else tuple(part[layers] for part in scored)

    def cuts(self, scores: torch.Tensor, window: int = 0, layers: list[int] | None = None) -> torch.Tensor:
        """The importance [L, B, H] a token needs to be kept in each layer and KV head, from every layer's
        scores [L, B, H, T] (``+inf``: kept whatever the cut, and not counted). The last ``window`` scored
        tokens stay in the exact window after the scored forward (kept when they leave it later), so they
        are not counted either: each head keeps the same number of the tokens flushed now. ``layers``: only
        those layers' cuts (the threshold still comes from every layer's scores)."""
        finite, counts, kept = self._select(self._scored(scores, window), layers)
        scores = scores if layers is None else scores[layers]
        ranked = scores.masked_fill(~finite, -math.inf).sort(dim=-1, descending=True).values  # [L, B, H, T]
        at = (kept - 1).clamp(min=0).to(scores.device)[:, :, None, None].expand(*ranked.shape[:-1], 1)
        cuts = ranked.gather(-1, at)[..., 0]  # each head's k-th largest scored token, k = its layer's kept count
        cuts = torch.where((kept == 0).to(scores.device)[:, :, None], math.inf, cuts)  # scored, none kept
        return torch.where((counts == 0).to(scores.device)[:, :, None], -math.inf, cuts)  # nothing scored: every token kept

    def segment_cuts(self, scores: torch.Tensor, window: int = 0, layers: list[int] | None = None) -> torch.Tensor:
        """``spread = "segments"``: each token's cut [L, B, H, T], the cut of its ``segment`` of positions, where
        each layer keeps the share of every segment's scored tokens it keeps of the whole context (the count
        :meth:`cuts` gives it), so every part of the context keeps its share of tokens, chosen by importance."""
        finite, counts, kept = self._select(self._scored(scores, window), layers)
        scores = scores if layers is None else scores[layers]
        layers, batch, heads, total = scores.shape  # type: ignore[assignment]
        size = self.segment
        pieces = -(-total // size)
        pad = pieces * size - total
        ranked = torch.nn.functional.pad(scores.masked_fill(~finite, -math.inf), (0, pad), value=-math.inf)
        ranked = ranked.reshape(layers, batch, heads, pieces, size).sort(dim=-1, descending=True).values
        scored = torch.nn.functional.pad(finite[:, :, 0], (0, pad)).reshape(layers, batch, pieces, size).sum(-1)  # [L, B, S]
        share = (kept.double() / counts.clamp(min=1).double())[..., None]  # [L, B, 1]
        want = torch.ceil(scored.double() * share).long().clamp(max=size)  # [L, B, S]
        pick = (want - 1).clamp(min=0)[:, :, None, :, None].expand(layers, batch, heads, pieces, 1)
        cut = ranked.gather(-1, pick)[..., 0]  # [L, B, H, S]
        cut = torch.where((want == 0)[:, :, None, :], torch.full_like(cut, math.inf), cut)
        cut = torch.where((scored == 0)[:, :, None, :], torch.full_like(cut, -math.inf), cut)
        return cut.repeat_interleave(size, dim=-1)[..., :total]


@hookimpl
def kvweave_register_evictors(registrar) -> None:
    registrar.add("kvzip", KVzipEvictor)
