"""What the cache observes of the model beyond K/V: the most recent queries of each layer (for the
router's attention features and the probe) and which tokens are delimiters (from the token ids).

Queries reach the cache through the ``kvweave-observe`` attention implementation (sdpa, plus a note of
the last ``observe_queries`` queries per layer); token ids through a forward pre-hook on the model's
input embeddings. Both are installed by :func:`kvweave.engine.binding.bind_model`. Everything kept here counts in the
cache's bytes ("observation").
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import ModelShape
from kvweave.core.linalg import float32_product
from kvweave.core.storage import tensor_bytes

ATTENTION_NAME = "kvweave-observe"
_active = threading.local()


def set_active(engine: Any) -> None:
    """Called by each cache layer's update: the attention call that follows belongs to ``engine``."""
    _active.engine = weakref.ref(engine)


def _observing_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    ref = getattr(_active, "engine", None)
    engine = ref() if ref is not None else None
    if engine is None or not engine.own_attention or not engine.owns(module.layer_idx, key):
        # another cache (or none) serves this forward: plain sdpa, nothing recorded
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    if engine.rows is not None:  # a left-padded batch, each row in an engine of its own (engine/rows.py)
        with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
            return engine.rows.attend(_engine_attention, module, query, attention_mask, **kwargs)
    # a layer placed on another GPU (device_map) launches the cache's kernels there, not on the current device
    with torch.cuda.device(query.device) if query.is_cuda else contextlib.nullcontext():
        return _engine_attention(engine, module, query, key, value, attention_mask, **kwargs)


def _engine_attention(engine, module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    scaling = kwargs.get("scaling") or getattr(module, "scaling", None)
    layer = module.layer_idx
    if engine.windows[layer].exact.static:  # a CUDA graph's step (engine/graphs.py refuses padded batches): transformers
        attention_mask = None  # builds the causal mask while a graph is captured, with the length of that step frozen in
    if engine.reads_in_place(query.shape[-2]):  # decode over the packed storage, read in place by the kernel
        unsupported = [name for name in ("softcap", "s_aux", "sinks") if kwargs.get(name) is not None]
        if unsupported:
            raise ModelError(
                f"layer {layer}: the model's attention uses {', '.join(unsupported)}, which pipeline "
                f"'{engine.pipeline.name}''s kernel '{engine.pipeline.slots['kernel'].use}' does not apply; use kernel 'reference'"
            )
        if engine.observer.active:
            engine.observer.record(layer, query, scaling, keys_seen=engine.seq_length(layer))
        if engine.energy is not None:
            engine.energy.record(layer, query, key.shape[1])
        engine.note_padding(attention_mask, query.shape[0])  # a flush after it may evict the tokens decoded here
        output = engine.kernel.attend(engine.view(layer), query, attention_mask, scaling or query.shape[-1] ** -0.5)
        engine.after_attention(layer)
        return output, None
    if engine.observer.active:
        engine.observer.record(module.layer_idx, query, scaling, key)
    if engine.energy is not None:
        engine.energy.record(module.layer_idx, query, key.shape[1])
    # K/V without the evicted tokens need their own mask (built from the model's mask over all tokens)
    attention_mask = engine.prepare_attention(module.layer_idx, query, key, attention_mask, scaling)
    output = ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)
    engine.after_attention(module.layer_idx)
    return output


def register_attention() -> None:
    """Register ``kvweave-observe`` with transformers' attention and mask interfaces (sdpa's mask)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION_NAME, _observing_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


@attrs.define
class _KeptInPlace:
    """An :class:`Observer` kept for a CUDA graph: the delimiter flags' buffer of the block's capacity (None without a
    token tap), the flags it held at the start, the steps taken since, what a step's flag index adds to the windows'
    fill, and the delimiter ids on the flags' device."""

    flags: torch.Tensor | None = None
    held: int = 0
    taken: int = 0
    offset: int = 0
    boundary: torch.Tensor | None = None


class Observer:
    """Recent queries per layer and delimiter flags of the tokens not yet compressed everywhere."""

    def __init__(self, shape: ModelShape, queries: int) -> None:
        self.shape = shape
        self.keep = queries
        self.tap: TokenTap | None = None
        self.boundary_ids: torch.Tensor | None = None
        #: the probe's ``select_queries`` when it picks query positions of each forward (set by the engine)
        self.selector: Any = None
        self.reset()

    @property
    def active(self) -> bool:
        return self.keep > 0

    def reset(self) -> None:
        self._queries: list[torch.Tensor | None] = [None] * self.shape.num_layers
        self.scaling: float | None = None
        self._flags: torch.Tensor | None = None  # [B, tokens since _flag_start]
        self._flag_start = 0
        self._ends: list[int] = [0] * self.shape.num_layers  # keys seen by each layer's last recorded forward
        # the probe's selection from the current forward: (queries [B, Hq, P, D], positions [B, P]) per layer
        self._selected: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * self.shape.num_layers
        self._static: _KeptInPlace | None = None  # kept for a CUDA graph (make_static)

    def start_forward(self, tokens: int, fill: torch.Tensor | None = None) -> None:
        """A forward of ``tokens`` tokens begins: its delimiter flags noted (kept for a CUDA graph: written at the
        step's index, from the window's ``fill`` on the device)."""
        self._selected = [None] * self.shape.num_layers
        if self.tap is None:
            return
        ids = self.tap.pending
        if ids is None or ids.shape[-1] != tokens:
            raise CacheStateError(
                f"the cache received {tokens} new tokens but the model's token ids were not seen (or did not "
                "match); call the model with input_ids, not inputs_embeds, when the router uses delimiter flags"
            )
        self.tap.pending = None
        kept = self._static
        if kept is not None:
            if kept.flags is None or fill is None or tokens != 1:
                raise CacheStateError("a CUDA graph's step notes one token's delimiter flag at the window's fill")
            kept.flags.index_copy_(1, (fill + kept.offset).long(), torch.isin(ids, kept.boundary).to(torch.uint8))
            return
        flags = torch.isin(ids, self.boundary_ids.to(ids.device)).to(torch.uint8)
        self._flags = flags if self._flags is None else torch.cat((self._flags, flags), dim=-1)

    def record(
        self, layer: int, query: torch.Tensor, scaling: float | None, key: torch.Tensor | None = None,
        keys_seen: int | None = None,
    ) -> None:
        """Keep the last ``keep`` queries [B, Hq, q, D] of ``layer``; with a ``selector`` and ``key`` [B, H, T, D]
        (all keys of the layer), also the probe's selection from a forward of more than ``keep`` tokens.
        ``keys_seen``: the layer's key count when ``key`` is not given (a kernel reading the cache in place)."""
        old = self._queries[layer]
        recent = query[..., -self.keep :, :].detach()
        self.scaling = scaling
        if self._static is not None:  # a CUDA graph's step: the same buffer, moved on by one query; the host's count
            old.copy_(torch.cat((old[..., 1:, :], recent.to(old.dtype)), dim=-2))  # of keys seen moves in advance()
            return
        joined = recent if old is None else torch.cat((old, recent), dim=-2)[..., -self.keep :, :]
        self._queries[layer] = joined.contiguous().clone()  # never a view of the whole query tensor
        if keys_seen is not None:
            self._ends[layer] = keys_seen
        if key is None:
            return
        self._ends[layer] = key.shape[-2]
        new = query.shape[-2]
        if self.selector is not None and new > self.keep:
            flags = None if self._flags is None or self._flags.shape[-1] < new else self._flags[:, -new:]
            picked = self.selector(query.detach(), key.detach(), flags, scaling).long()  # [B, P] in 0..new-1
            index = picked.to(query.device)[:, None, :, None].expand(-1, query.shape[1], -1, query.shape[-1])
            chosen = query.detach().gather(2, index).contiguous().clone()
            self._selected[layer] = (chosen, (key.shape[-2] - new + picked).to(torch.int32))

    def queries(self, layer: int) -> torch.Tensor:
        return self._queries[layer]  # type: ignore[return-value]

    # ------------------------------------------------------------------------- kept for a CUDA graph
    def make_static(self, steps: int, held_tokens: int) -> None:
        """Keep what each decode step records in place for ``steps`` steps (:mod:`kvweave.engine.graphs`): each layer's
        ``keep`` recent queries move on inside their own tensor, and the delimiter flags go into a buffer of the steps'
        capacity at the index the windows' fill (the device's count of their tokens, ``held_tokens`` now) gives
        (:meth:`start_forward`). Every layer must hold ``keep`` queries already (a prompt at least that long)."""
        if self._static is not None:
            raise CacheStateError("the observer is kept for a CUDA graph already")
        if self.keep:
            short = [layer for layer, q in enumerate(self._queries) if q is None or q.shape[-2] != self.keep]
            if short:
                raise CacheStateError(f"layers {short} hold fewer than the {self.keep} observed queries a CUDA graph's "
                                      "step moves on in place; decode that many tokens before replaying steps")
        kept = _KeptInPlace()
        if self.tap is not None:
            if self._flags is None:
                raise CacheStateError("no delimiter flags were noted yet; feed the prompt before replaying steps")
            kept.held = self._flags.shape[-1]
            kept.flags = self._flags.new_zeros(self._flags.shape[0], kept.held + steps)
            kept.flags[:, : kept.held] = self._flags
            kept.boundary = self.boundary_ids.to(kept.flags.device)
        kept.offset = kept.held - held_tokens
        self._static = kept

    def advance(self, steps: int = 1) -> None:
        """The host's counts moved on by ``steps`` decode steps that ran as a CUDA graph's (each layer's keys seen and
        the flags noted; the device's were, by the steps themselves)."""
        kept = self._static
        if kept is None:
            raise CacheStateError("only an observer kept for a CUDA graph advances by count")
        if kept.flags is not None and kept.held + kept.taken + steps > kept.flags.shape[-1]:
            raise CacheStateError(f"the flags kept for a CUDA graph hold {kept.flags.shape[-1]}; "
                                  f"{kept.held + kept.taken} + {steps} do not fit")
        kept.taken += steps
        if self.keep:
            self._ends = [end + steps for end in self._ends]

    def end_static(self) -> None:
        """Back to tensors of their own length: the flags noted so far (before a flush)."""
        kept, self._static = self._static, None
        if kept is not None and kept.flags is not None:
            self._flags = kept.flags[:, : kept.held + kept.taken].clone()

    def probe_queries(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Queries [B, Hq, P, D] and their logical positions [B, P] for the router: the probe's selection from
        the current forward when it made one, else the recent queries (None before any was recorded)."""
        if self._selected[layer] is not None:
            return self._selected[layer]
        recent = self._queries[layer]
        if recent is None:
            return None
        observed = recent.shape[-2]
        positions = torch.arange(self._ends[layer] - observed, self._ends[layer], device=recent.device, dtype=torch.int32)
        return recent, positions.expand(recent.shape[0], -1)

    def forget_selection(self, layers: tuple[int, ...]) -> None:
        """Drop the probe's selection of ``layers`` once their group has been routed (it is not kept)."""
        for layer in layers:
            self._selected[layer] = None

    def forget_queries(self, layers: tuple[int, ...]) -> None:
        """Drop the recent queries of ``layers`` (when only the forward that flushes needs them)."""
        for layer in layers:
            self._queries[layer] = None

    def _recent_logits(self, layer: int, keys: torch.Tensor) -> torch.Tensor:
        """Logits [B, H, (Hq/H) * o, T] of the recent queries on ``keys`` [B, H, T, D] (the queries being the
        last ``o`` of those tokens), a key after its query masked to -inf."""
        queries = self._queries[layer]
        batch, q_heads, observed, dim = queries.shape
        heads = keys.shape[1]
        grouped = queries.reshape(batch, heads, q_heads // heads * observed, dim)
        scale = self.scaling or dim**-0.5
        logits = float32_product(grouped, keys.transpose(-1, -2)).mul_(scale)  # a 16-bit window on a GPU read as it is
        total = keys.shape[-2]
        query_pos = (total - observed + torch.arange(observed, device=keys.device)).repeat(q_heads // heads)
        key_pos = torch.arange(total, device=keys.device)
        return logits.masked_fill(key_pos[None, :] > query_pos[:, None], float("-inf"))

    def attention_stats(
        self, layer: int, keys: torch.Tensor, block: int, first: int, valid: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed and largest attention probability of the recent queries on keys ``first .. first+block``.

        ``keys`` [B, H, T, D] all keys of ``layer`` (the queries being the last tokens); ``valid`` [B, H, T]
        False for keys no query may see (padding, evicted slots); returns two [B, H, block] tensors."""
        logits = self._recent_logits(layer, keys)
        if valid is not None:
            logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
        probs = logits.softmax(dim=-1).nan_to_num(0.0)
        if valid is not None:  # a padding query (its own key invalid) gives no attention
            _, q_heads, observed, _ = self._queries[layer].shape
            group = q_heads // keys.shape[1]
            probs = probs * valid[:, :, keys.shape[-2] - observed :].repeat(1, 1, group)[..., None]
        probs = probs[..., first : first + block]
        return probs.sum(dim=-2), probs.amax(dim=-2)

    def attention_stats_exact(
        self, layer: int, exact_keys: torch.Tensor, packed_lse: torch.Tensor | None, block: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`attention_stats` for a block at the start of the exact window, without the packed keys:
        ``exact_keys`` [B, H, W, D] the layer's exact window (the recent queries being its last tokens),
        ``packed_lse`` [B, Hq, o] the log-sum-exp of the recent queries over the packed tokens (None when
        there are none), all of which every recent query sees. Returns two [B, H, block] tensors."""
        logits = self._recent_logits(layer, exact_keys)
        lse = logits.logsumexp(dim=-1)
        if packed_lse is not None:
            lse = torch.logaddexp(lse, packed_lse.float().reshape(lse.shape))
        probs = (logits[..., :block] - lse[..., None]).exp()
        return probs.sum(dim=-2), probs.amax(dim=-2)

    def boundaries(self, first: int, block: int, device: torch.device | None = None) -> torch.Tensor | None:
        """Delimiter flags [B, block] of logical tokens ``first .. first+block`` (on ``device``: the layers'
        own when a model's layers sit on several devices)."""
        if self._flags is None:
            return None
        start = first - self._flag_start
        return self._flags[:, start : start + block].to(device=device, dtype=torch.float32)

    def forget_boundaries(self, upto: int) -> None:
        """Drop flags of tokens every layer has compressed."""
        if self._flags is not None and upto > self._flag_start:
            self._flags = self._flags[:, upto - self._flag_start :].clone()
            self._flag_start = upto

    def nbytes(self) -> int:
        tensors = [q for q in self._queries if q is not None]
        tensors += [t for pair in self._selected if pair is not None for t in pair]
        if self._flags is not None:
            tensors.append(self._flags)
        return tensor_bytes(tensors)

    def select_batch(self, index: torch.Tensor) -> None:
        self._queries = [None if q is None else q.index_select(0, index.to(q.device)) for q in self._queries]
        self._selected = [
            None if pair is None else tuple(t.index_select(0, index.to(t.device)) for t in pair)  # type: ignore[misc]
            for pair in self._selected
        ]
        if self._flags is not None:
            self._flags = self._flags.index_select(0, index.to(self._flags.device))


@contextlib.contextmanager
def plain_attention(model: Any) -> Iterator[None]:
    """Use plain sdpa for the duration (a model bound to an observing pipeline would otherwise report a
    reference pass's queries to the last compressed cache that ran); identical numbers."""
    previous = getattr(model.config, "_attn_implementation", None)
    if previous != ATTENTION_NAME:
        yield
        return
    model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def cache_argument_name(model: Any) -> str:
    """``"cache"`` where the model's forward takes it (transformers >= 5.24), else ``"past_key_values"``."""
    parameters = inspect.signature(type(model).forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """``{name: cache}`` for ``model.generate(**inputs, **cache_kwargs(model, cache))``."""
    return {cache_argument_name(model): cache}
