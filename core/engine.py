"""The compression engine behind :class:`kvweave.core.cache.KVWeaveCache`.

Per layer, new tokens enter an exact window (model dtype). Once every layer of a basis group holds
``recent_window + block_tokens`` exact tokens, the oldest whole blocks leave the window: the basis
encodes them to coefficients ``[S, B, H, n, r]``, the quantizer packs those, and, where the router
gives a token a residual rank ``rho > 0``, the ``rho`` largest channels of what the packed coefficients
miss are kept as channel indices (uint8) plus values packed by the residual quantizer. The exact
copies are then dropped, so the memory is really freed.

``update`` returns the K/V the model attends over: the stored blocks reconstructed, then the exact
window (the reference path). Tokens are compressed after the forward pass that added them, so a
prompt attends to itself exactly during prefill and compressed afterwards.
"""

from __future__ import annotations

import torch

from .errors import CacheStateError, ComponentError, ModelError
from .interfaces import AttentionKernel, BasisBuilder, ModelShape, Probe, Quantizer, Router
from .registry import ResolvedPipeline
from .storage import Segment, TensorMap, tensor_bytes

KINDS = ("keys", "values")


class LayerWindow:
    """The exact (uncompressed) recent tokens of one layer, and how many of its tokens are stored packed."""

    def __init__(self) -> None:
        self.exact: dict[str, torch.Tensor | None] = {"keys": None, "values": None}
        self.compressed_tokens = 0

    @property
    def exact_tokens(self) -> int:
        tensor = self.exact["keys"]
        return 0 if tensor is None else tensor.shape[-2]


class GroupStore:
    """Packed blocks of one basis group for keys or values, plus the basis state they decode with."""

    def __init__(self) -> None:
        self.state: TensorMap | None = None
        self.coefficients = Segment()
        self.residual_index = Segment()
        self.residual = Segment()

    def segments(self) -> tuple[Segment, ...]:
        return (self.coefficients, self.residual_index, self.residual)


class CompressionEngine:
    """Holds every stored tensor of a compressed cache and does the encoding and reconstruction."""

    def __init__(self, pipeline: ResolvedPipeline, shape: ModelShape) -> None:
        self.pipeline = pipeline
        self.shape = shape
        self.settings = pipeline.settings
        self.basis: BasisBuilder = pipeline.component("basis")  # type: ignore[assignment]
        self.quantizer: Quantizer = pipeline.component("quantizer")  # type: ignore[assignment]
        self.router: Router = pipeline.component("router")  # type: ignore[assignment]
        self.residual_quantizer: Quantizer = pipeline.component("residual_quantizer")  # type: ignore[assignment]
        self.probe: Probe = pipeline.component("probe")  # type: ignore[assignment]
        self.kernel: AttentionKernel = pipeline.component("kernel")  # type: ignore[assignment]
        for slot in pipeline.slots:
            pipeline.component(slot).check_model(shape)
        self.groups = self.basis.layer_groups(shape)
        self.group_of = self._index_groups()
        where = f"pipeline '{pipeline.name}'"
        self.quantizer.check_width(self.basis.coefficient_width(shape), f"{where}, slot 'quantizer' (coefficients)")
        levels = self.router.levels()
        if len(levels) != 1:
            raise ComponentError(
                f"{where}: router '{pipeline.slots['router'].use}' assigns {len(levels)} rank levels {levels}; "
                "this engine stores one residual rank per pipeline (a router with a single level, e.g. 'uniform')"
            )
        self.residual_rank = levels[0]
        if self.residual_rank > 0:
            self.residual_quantizer.check_width(self.residual_rank, f"{where}, slot 'residual_quantizer' (rank {self.residual_rank})")
        self.windows = [LayerWindow() for _ in range(shape.num_layers)]
        self.stores = [{kind: GroupStore() for kind in KINDS} for _ in self.groups]

    def _index_groups(self) -> dict[int, tuple[int, int]]:
        group_of: dict[int, tuple[int, int]] = {}
        for group_index, members in enumerate(self.groups):
            for member, layer in enumerate(members):
                if layer in group_of or not 0 <= layer < self.shape.num_layers:
                    raise ComponentError(
                        f"pipeline '{self.pipeline.name}': basis '{self.pipeline.slots['basis'].use}' returned layer "
                        f"groups {self.groups}, which are not a partition of layers 0..{self.shape.num_layers - 1}"
                    )
                group_of[layer] = (group_index, member)
        if len(group_of) != self.shape.num_layers:
            missing = sorted(set(range(self.shape.num_layers)) - set(group_of))
            raise ComponentError(f"pipeline '{self.pipeline.name}': layers {missing} are in no basis group")
        return group_of

    # ----------------------------------------------------------------------------------- update
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``keys``/``values`` [B, H, q, D] to ``layer``; return its full K/V [B, H, T, D]."""
        if not 0 <= layer < self.shape.num_layers:
            raise CacheStateError(f"layer index {layer} is outside the cache's {self.shape.num_layers} layers")
        if keys.shape[1] != self.shape.num_kv_heads or keys.shape[-1] != self.shape.head_dim:
            raise ModelError(
                f"layer {layer} sent keys shaped {tuple(keys.shape)}; the cache was built for "
                f"{self.shape.num_kv_heads} KV heads of dim {self.shape.head_dim}"
            )
        window = self.windows[layer]
        for kind, new in zip(KINDS, (keys, values)):
            old = window.exact[kind]
            window.exact[kind] = new if old is None else torch.cat((old, new), dim=-2)
        full = tuple(self._full(layer, kind) for kind in KINDS)
        group_index, member = self.group_of[layer]
        if self.settings.compress and member == len(self.groups[group_index]) - 1:
            self._flush(group_index)
        return full  # type: ignore[return-value]

    def _full(self, layer: int, kind: str) -> torch.Tensor:
        exact = self.windows[layer].exact[kind]
        if self.windows[layer].compressed_tokens == 0:
            return exact  # type: ignore[return-value]
        return torch.cat((self.reconstruct(layer, kind, exact.dtype), exact), dim=-2)  # type: ignore[union-attr]

    # ------------------------------------------------------------------------------- compress
    def _flush(self, group_index: int) -> None:
        members = self.groups[group_index]
        ready = min(self.windows[layer].exact_tokens for layer in members) - self.settings.recent_window
        count = (ready // self.settings.block_tokens) * self.settings.block_tokens
        if count <= 0:
            return
        for kind in KINDS:
            block = torch.stack([self.windows[layer].exact[kind][..., :count, :] for layer in members])
            self._encode(self.stores[group_index][kind], members, block)
        for layer in members:
            window = self.windows[layer]
            for kind in KINDS:
                # clone: a slice would keep the whole old window's storage alive
                window.exact[kind] = window.exact[kind][..., count:, :].clone()
            window.compressed_tokens += count

    def _encode(self, store: GroupStore, members: tuple[int, ...], block: torch.Tensor) -> None:
        """Encode ``block`` [G, B, H, n, D] into ``store``."""
        work = block.float()
        if store.state is None:
            store.state = self.basis.init_state(work)
        coefficients = self.basis.encode(store.state, work)
        packed = self.quantizer.quantize(coefficients)
        store.coefficients.append(packed)
        if self.residual_rank == 0:
            return
        decoded = self.quantizer.dequantize(packed, torch.float32)
        indices, residual_values = [], []
        for member, layer in enumerate(members):
            missing = work[member] - self.basis.decode(store.state, decoded, member)
            ranks = self.router.assign(layer, work[member])
            if not bool((ranks == self.residual_rank).all()):
                raise ComponentError(f"router '{self.pipeline.slots['router'].use}' assigned ranks outside its levels")
            top = missing.abs().topk(self.residual_rank, dim=-1).indices
            indices.append(top.to(torch.uint8))
            residual_values.append(missing.gather(-1, top))
        store.residual_index.append({"index": torch.stack(indices)})
        store.residual.append(self.residual_quantizer.quantize(torch.stack(residual_values)))

    # -------------------------------------------------------------------------- reconstruct
    def reconstruct(self, layer: int, kind: str, dtype: torch.dtype) -> torch.Tensor:
        """The stored (packed) tokens of ``layer`` decoded to [B, H, T_packed, D] in ``dtype``."""
        group_index, member = self.group_of[layer]
        store = self.stores[group_index][kind]
        coefficients = self.quantizer.dequantize(store.coefficients.fields, dtype)
        vectors = self.basis.decode(store.state or {}, coefficients, member)
        if self.residual_rank > 0:
            values = self.residual_quantizer.dequantize(store.residual.fields, dtype)[member]
            index = store.residual_index.fields["index"][member].long()
            vectors = vectors.clone().scatter_add_(-1, index, values)
        return vectors

    # ------------------------------------------------------------------------------ queries
    def seq_length(self, layer: int = 0) -> int:
        window = self.windows[layer]
        return window.compressed_tokens + window.exact_tokens

    def memory_breakdown(self) -> dict[str, int]:
        """Stored bytes by part: exact window, coefficients, residuals (indices included), basis state."""
        exact = [t for w in self.windows for t in w.exact.values() if t is not None]
        stores = [store for group in self.stores for store in group.values()]
        return {
            "exact_window": tensor_bytes(exact),
            "coefficients": sum(store.coefficients.nbytes() for store in stores),
            "residuals": sum(store.residual.nbytes() + store.residual_index.nbytes() for store in stores),
            "basis_state": tensor_bytes(t for store in stores for t in (store.state or {}).values()),
        }

    def memory_bytes(self) -> int:
        return sum(self.memory_breakdown().values())

    def batch_size(self) -> int:
        tensor = self.windows[0].exact["keys"]
        return -1 if tensor is None else tensor.shape[0]

    # ---------------------------------------------------------------------------- batch ops
    def map_batch(self, fn) -> None:
        """Apply ``fn`` (taking a tensor and its batch dim) to every stored tensor."""
        for window in self.windows:
            for kind in KINDS:
                if window.exact[kind] is not None:
                    window.exact[kind] = fn(window.exact[kind], 0)
        for group in self.stores:
            for store in group.values():
                for segment in store.segments():
                    segment.map(lambda tensor: fn(tensor, 1))
                if store.state:
                    store.state = {name: fn(tensor, 0) for name, tensor in store.state.items()}

    def reset(self) -> None:
        self.windows = [LayerWindow() for _ in range(self.shape.num_layers)]
        self.stores = [{kind: GroupStore() for kind in KINDS} for _ in self.groups]
