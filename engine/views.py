"""The typed read-only view of one layer's storage (:class:`kvweave.core.view.LayerView`), built from the
engine's store: what kernels, metrics, training and tests read instead of engine internals."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvweave.core.errors import CacheStateError
from kvweave.core.host_to_device import on_device
from kvweave.core.interfaces import KINDS
from kvweave.core.view import KindView, LayerView, ResidualLevelView
from kvweave.engine.residuals import TILE_TOKENS

if TYPE_CHECKING:
    from kvweave.engine.engine import CompressionEngine


def layer_view(engine: CompressionEngine, layer: int) -> LayerView:
    """``layer``'s packed storage, typed and read-only (:class:`kvweave.core.view.LayerView`)."""
    if not 0 <= layer < engine.shape.num_layers:
        raise CacheStateError(f"layer index {layer} is outside the cache's {engine.shape.num_layers} layers")
    group_index, member = engine.group_of[layer]
    window = engine.windows[layer]
    shared = engine.basis.coefficient_rows(len(engine.groups[group_index])) == 1
    stores = engine.stores[group_index]
    exact = window.exact.shape()
    rows = 0 if exact is None else exact[0] * exact[1]
    device = window.exact.device
    attending = engine.attending.get(layer)  # a lossy window with this forward's own tokens exact
    if window.exact.static:  # kept for a CUDA graph: its read-back buffers, the length on the device
        attending = (window.exact.read_buffer("keys"), window.exact.read_buffer("values"))
    elif attending is not None and attending[0].shape[-2] != window.exact_tokens:
        attending = None  # the window moved since (a flush): read what it holds
    kinds = {}
    for kind in KINDS:
        store = stores[kind]
        state = store.state or {}
        levels = []
        for rank in engine.residual_levels:
            lists = window.residuals[kind][rank]
            start = mask = None
            if engine.kernel.builds_residual_tiles and exact is not None:
                start, mask = lists.tile_index(rows, window.compressed_tokens // TILE_TOKENS, device)
            levels.append(ResidualLevelView(rank, lists.fields, start, mask, lists.located))
        factored = engine.basis.factor_bases(store.state, member) if store.state else None
        kinds[kind] = KindView(
            kind=kind,
            coefficients=store.coefficients.fields,
            coefficient_row=0 if shared else member,
            coefficient_format=engine.quantizer(group_index, kind).packed_format,
            basis_state=state,
            factor_bases=factored,
            residuals=tuple(levels),
            residual_format=engine.residual_quantizers[kind].packed_format,
            residual_basis=window.residual_basis[kind],
            gates=on_device(engine.router.gates(layer, kind), device),
            exact=attending[KINDS.index(kind)] if attending is not None else window.exact[kind],
            quantizer=engine.quantizer(group_index, kind),
        )
    return LayerView(
        layer=layer, group=group_index, member=member, packed_tokens=window.compressed_tokens,
        passed_tokens=window.passed_tokens, flushes=stores["keys"].flushes, keys=kinds["keys"],
        values=kinds["values"], positions=window.positions, scratch=engine.kernel_state, scores=window.scores, key_space=engine.settings.key_space, rotary=engine.rotary,
        window_fill=window.exact.fill,
    )
