"""``fused``: decode attention read straight from the packed cache (coefficients x bases, routed int4
residuals, the exact window), by the Triton kernel of :mod:`kvweave.kernels.depthweave_decode`.

The cache's ``update`` then returns only the exact window for one-token forwards, and kvweave's
attention (``kvweave-observe``) calls :meth:`FusedKernel.attend` instead of sdpa: no key or value of the
packed tokens is reconstructed. Forwards of several tokens (the prompt) run the model's usual sdpa
attention over reconstructed K/V.

What it reads (checked when the cache is built, with an error naming the slot otherwise): a basis with
``factor_bases`` (``sketch-ema``), ``int8-block`` coefficients of rank up to 64, residuals in
``residual_mode = "basis"`` packed by ``int4-group`` (at most three rank levels, no depth mixing), no
eviction, ``block_tokens`` a multiple of 32, head_dim 64, 128 or 256.

``backend``: ``auto`` runs the Triton kernel on CUDA tensors and the kernel's torch twin (the same
coefficient-space computation, :func:`~kvweave.kernels.depthweave_decode.torch_decode`) elsewhere;
``triton`` and ``torch`` force one (``triton`` on a CPU needs ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs
import torch

from kvweave.core import hookimpl
from kvweave.core.errors import CacheStateError, ComponentError, ModelError
from kvweave.core.interfaces import AttentionKernel
from kvweave.core.params import choice, integer
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.plugins.quantizers.int8_block import Int8BlockQuantizer

from kvweave.kernels.depthweave_decode import (
    MAX_LEVELS, TILE, DecodeView, ResidualLevel, choose_split, fused_decode, fused_packed_logsumexp, placeholder,
    torch_decode, torch_packed_logsumexp, version_segments,
)

BACKENDS = ("auto", "triton", "torch")
HEAD_DIMS = (64, 128, 256)


@attrs.frozen
class FusedKernel(AttentionKernel):
    """Attend over int8 coefficients, int4 residuals and the exact window without reconstructing K/V."""

    materializes: ClassVar[bool] = False

    backend: str = attrs.field(default="auto", validator=choice(BACKENDS), metadata={"doc": "'auto' (Triton on CUDA, the torch twin elsewhere), 'triton' or 'torch'"})
    split_tokens: int = attrs.field(default=0, validator=integer(0), metadata={"doc": "packed tokens per kernel program (a multiple of 32); 0 chooses enough programs to fill the GPU"})

    @split_tokens.validator
    def _tile_multiple(self, attribute, value) -> None:
        if value % TILE:
            raise ValueError(f"'split_tokens' must be a multiple of {TILE} (0 = automatic), got {value}")

    # ---------------------------------------------------------------------------------- checks
    def check_engine(self, engine: Any) -> None:
        slots = engine.pipeline.slots
        where = f"pipeline '{engine.pipeline.name}', slot 'kernel' ('fused')"
        shape = engine.shape
        if shape.head_dim not in HEAD_DIMS:
            raise ModelError(f"{where}: head_dim {shape.head_dim} is not one of {HEAD_DIMS}; use kernel 'reference'")
        if not engine.settings.compress:
            raise ComponentError(f"{where}: the pipeline stores nothing packed (compress = false); use kernel 'reference'")
        if not _overrides_factor(engine.basis):
            raise ComponentError(
                f"{where}: basis '{slots['basis'].use}' does not store coefficients times bases (no factor_bases); "
                "the fused kernel reads bases such as 'sketch-ema'; use kernel 'reference'"
            )
        if not isinstance(engine.quantizer, Int8BlockQuantizer):
            raise ComponentError(f"{where}: coefficients must be packed by 'int8-block', not '{slots['quantizer'].use}'")
        rank = engine.basis.coefficient_width(shape)
        if rank > 64:
            raise ComponentError(f"{where}: the coefficient rank {rank} is above the kernel's 64")
        if engine.evicts or engine.accumulates:
            raise ComponentError(f"{where}: router '{slots['router'].use}' evicts tokens or accumulates attention; use kernel 'reference'")
        if engine.settings.block_tokens % TILE:
            raise ComponentError(f"{where}: block_tokens {engine.settings.block_tokens} must be a multiple of {TILE}")
        levels = engine.residual_levels
        if levels:
            if engine.settings.residual_mode != "basis":
                raise ComponentError(
                    f"{where}: residuals must be stored in residual_mode = \"basis\" (coordinates on a residual basis), "
                    f"not {engine.settings.residual_mode!r}; set it, or use kernel 'reference'"
                )
            if not isinstance(engine.residual_quantizer, Int4GroupQuantizer):
                raise ComponentError(f"{where}: residuals must be packed by 'int4-group', not '{slots['residual_quantizer'].use}'")
            if len(levels) > MAX_LEVELS:
                raise ComponentError(f"{where}: the router has {len(levels)} residual rank levels {levels}; the kernel takes at most {MAX_LEVELS}")
            if any(engine.basis.residual_mixing(len(group)) is not None for group in engine.groups):
                raise ComponentError(f"{where}: basis '{slots['basis'].use}' mixes residual rows across layers; use kernel 'reference'")

    # ---------------------------------------------------------------------------------- views
    def layer_view(self, engine: Any, layer: int, device: torch.device) -> DecodeView:
        """The packed storage of ``layer`` as the kernel reads it (views; the tile index is extended in place)."""
        group_index, member = engine.group_of[layer]
        window = engine.windows[layer]
        stores = engine.stores[group_index]
        tokens = window.compressed_tokens
        exact_k, exact_v = window.exact["keys"], window.exact["values"]
        batch, heads = exact_k.shape[:2]
        state = engine.kernel_state
        if tokens == 0:
            empty = exact_k.new_zeros(0)
            return DecodeView(0, empty, empty, empty, empty, empty, empty, torch.zeros(0, 3, dtype=torch.int32, device=device),
                              (), (), None, None, None, None, exact_k, exact_v)
        row = 0 if engine.basis.coefficient_rows(len(engine.groups[group_index])) == 1 else member
        fields = {kind: stores[kind].coefficients.fields for kind in ("keys", "values")}
        bases = {}
        for kind in ("keys", "values"):
            factored = engine.basis.factor_bases(stores[kind].state, member)
            if factored is None:
                raise CacheStateError(f"layer {layer}: basis state of the {kind} has no bases to attend with")
            bases[kind] = factored
        key = ("segments", group_index)
        cached = state.get(key)
        stamp = (stores["keys"].flushes, tokens, batch)
        if cached is None or cached[0] != stamp:
            counts = [int(c) for c in bases["keys"][1].tolist()]
            if counts != [int(c) for c in bases["values"][1].tolist()] or sum(counts) != tokens:
                raise CacheStateError(f"layer {layer}: key and value bases cover different tokens ({counts})")
            split = self.split_tokens or choose_split(tokens, batch * heads)
            cached = (stamp, version_segments(counts, split, device))
            state[key] = cached
        levels: dict[str, tuple[ResidualLevel, ...]] = {"keys": (), "values": ()}
        for kind in ("keys", "values") if engine.residual_levels else ():
            built = []
            for rank in engine.residual_levels:
                lists = window.residuals[kind][rank]
                start, mask = lists.tile_index(batch * heads, tokens // TILE, device)
                group = min(engine.residual_quantizer.group, rank)
                if lists.entries:
                    f = lists.fields
                    built.append(ResidualLevel(rank, group, f["token"], f["row"], f["q_packed"], f["q_scales"], start, mask))
                else:
                    none = placeholder(device)
                    built.append(ResidualLevel(rank, group, none[:0], none[:0], placeholder(device, torch.uint8),
                                               placeholder(device, torch.float16), start, mask))
            levels[kind] = tuple(built)
        gates = {kind: engine.router.gates(layer, kind) for kind in ("keys", "values")}
        gates = {kind: None if g is None else _on(state, ("gates", layer, kind), g, device) for kind, g in gates.items()}
        return DecodeView(
            packed_tokens=tokens,
            k_codes=fields["keys"]["codes"][row], k_scales=fields["keys"]["scales"][row],
            v_codes=fields["values"]["codes"][row], v_scales=fields["values"]["scales"][row],
            k_bases=bases["keys"][0], v_bases=bases["values"][0], segments=cached[1],
            k_levels=levels["keys"], v_levels=levels["values"],
            k_residual_basis=window.residual_basis["keys"], v_residual_basis=window.residual_basis["values"],
            k_gates=gates["keys"], v_gates=gates["values"], exact_k=exact_k, exact_v=exact_v,
        )

    # ---------------------------------------------------------------------------------- attention
    def attend(self, engine: Any, layer: int, query: torch.Tensor, attention_mask: Any, scaling: float) -> torch.Tensor:
        if query.shape[-2] != 1:
            raise CacheStateError(f"the fused kernel decodes one token per sequence; layer {layer} got {query.shape[-2]}")
        view = self.layer_view(engine, layer, query.device)
        start = first_positions(engine, attention_mask, query.device)
        q = query[:, :, 0, :]
        out = fused_decode(view, q, start, scaling) if self._triton(query) else torch_decode(view, q, start, scaling)
        return out.unsqueeze(1)  # [B, 1, Hq, D], as the model's attention returns it

    def packed_logsumexp(self, engine: Any, layer: int, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """log-sum-exp over ``layer``'s packed tokens of ``queries`` [B, Hq, o, D] (times ``scaling``):
        [B, Hq, o], read from the packed storage. The engine's attention statistics use it at a flush, so
        routing never reconstructs a layer's keys either."""
        batch, q_heads, observed, dim = queries.shape
        view = self.layer_view(engine, layer, queries.device)
        flat = queries.reshape(batch, q_heads * observed, dim)
        if self._triton(queries):
            lse = fused_packed_logsumexp(view, flat, scaling)
        else:
            lse = torch_packed_logsumexp(view, flat, scaling)
        return lse.reshape(batch, q_heads, observed)

    def _triton(self, tensor: torch.Tensor) -> bool:
        return self.backend == "triton" or (self.backend == "auto" and tensor.is_cuda)


def _overrides_factor(basis: Any) -> bool:
    from kvweave.core.interfaces import BasisBuilder

    return type(basis).factor_bases is not BasisBuilder.factor_bases


def _on(state: dict, key: tuple, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    cached = state.get(key)
    if cached is None or cached.device != device:
        cached = tensor.to(device=device, dtype=torch.float32).contiguous()
        state[key] = cached
    return cached


def first_positions(engine: Any, attention_mask: Any, device: torch.device) -> torch.Tensor | None:
    """The first logical position each row attends to, int32 [B], from the model's mask for a one-token
    forward (None: no mask). A mask may hide a prefix only (left padding, a sliding window); one that hides a
    token after a visible one is refused. Computed once per mask: a forward passes one mask per layer type
    (full and sliding layers alternate), so the last two are kept."""
    if attention_mask is None:
        return None
    recent = engine.kernel_state.setdefault("masks", [])
    for mask, start in recent:
        if mask is attention_mask:
            return start
    mask = attention_mask[:, 0, -1, :]  # [B, kv]
    allowed = mask if mask.dtype == torch.bool else mask == 0
    positions = torch.arange(allowed.shape[-1], device=allowed.device)
    first = torch.where(allowed, positions, allowed.shape[-1]).amin(dim=-1)
    if not bool((allowed == (positions[None, :] >= first[:, None])).all()):
        raise CacheStateError(
            "the fused kernel takes masks that hide a prefix only (left padding, sliding windows); this attention "
            "mask hides a token after a visible one"
        )
    start = first.to(device=device, dtype=torch.int32)
    recent[:] = [*recent[-1:], (attention_mask, start)]
    return start


@hookimpl
def kvweave_register_kernels(registrar) -> None:
    registrar.add("fused", FusedKernel)
