"""The engine's stored state: one :class:`LayerWindow` per layer (exact recent tokens, routed residuals,
counts) and one :class:`GroupStore` per basis group and kind (packed coefficients, basis state, budget
share). Only the engine and its collaborators write them; everything else reads a
:class:`~kvweave.core.view.LayerView`.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.core.errors import ModelError
from kvweave.core.interfaces import KINDS
from kvweave.core.registry import WINDOW_STORAGE
from kvweave.core.storage import Segment, TensorMap, tensor_bytes
from kvweave.engine.residuals import ResidualList
from kvweave.engine.slot_index import SlotIndex
from kvweave.kernels.window import append_int8

#: int8 window: one float16 scale per (token, head) is ``absmax / 127``, so absmax may reach 127 x 65504
_INT8_LIMIT = 127 * 65504.0


class ExactTokens:
    """A layer's tokens not (yet) compressed, for keys and values, each [B, H, n, D].

    ``storage = "input"`` holds the tensors as they arrive. ``storage = "int8"`` holds each vector as int8
    codes ``round(x / s)`` with one float16 scale ``s = absmax / 127`` per (token, head) (``D + 2`` bytes a
    vector instead of ``2 D``); reading a kind dequantizes it to the dtype it arrived in, every element within
    ``s / 2`` of what was stored (plus float16's rounding of ``s``, which clamps at most one step). Tokens are
    appended, dropped from the front and batch rows selected on the stored codes, never re-quantized.
    """

    def __init__(self, storage: str = "input") -> None:
        if storage not in WINDOW_STORAGE:
            raise ValueError(f"window_storage must be one of {list(WINDOW_STORAGE)}, got {storage!r}")
        self.storage = storage
        self._held: dict[str, tuple[torch.Tensor, ...] | None] = {kind: None for kind in KINDS}
        self._dtype: torch.dtype | None = None
        self._watched: list[tuple[torch.Tensor, Any]] = []  # decode steps' largest magnitudes, on their way to the host
        self._worst: torch.Tensor | None = None  # the append kernel's running largest magnitude, on the tokens' device
        self.fused: bool | None = None  # decode tokens of an int8 window by one kernel: None where they are on a GPU

    @property
    def lossy(self) -> bool:
        """Whether reading returns something other than what arrived (int8 storage)."""
        return self.storage != "input"

    def __getitem__(self, kind: str) -> torch.Tensor | None:
        held = self._held[kind]
        if held is None:
            return None
        if not self.lossy:
            return held[0]
        codes, scale = held
        return (codes.float() * scale.float()).to(self._dtype)

    def __setitem__(self, kind: str, tensor: torch.Tensor | None) -> None:
        self._held[kind] = None if tensor is None else self._encode(tensor)

    def tokens(self) -> int:
        held = self._held["keys"]
        return 0 if held is None else held[0].shape[-2]

    def shape(self, kind: str = "keys") -> torch.Size | None:
        """The shape reading ``kind`` gives, without dequantizing."""
        held = self._held[kind]
        return None if held is None else held[0].shape

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype reading gives (the tokens' own), without dequantizing."""
        return self._dtype

    @property
    def device(self) -> torch.device | None:
        held = self._held["keys"]
        return None if held is None else held[0].device

    def append(self, kind: str, new: torch.Tensor) -> None:
        encoded = self._encode(new)
        old = self._held[kind]
        self._held[kind] = encoded if old is None else tuple(torch.cat((a, b), dim=-2) for a, b in zip(old, encoded))

    def append_read(self, kind: str, new: torch.Tensor) -> torch.Tensor:
        """Append ``new`` and return ``kind`` as this forward attends over it: the held tokens as read, ``new`` as it
        arrived at its own positions. An int8 window on a GPU takes a decode token by one kernel
        (:func:`kvweave.kernels.window.append_int8`; ``fused`` True forces it, e.g. in Triton's interpreter, False
        never), its largest magnitude checked as :meth:`settle` says."""
        old = self._held[kind]
        if self.lossy and old is not None and new.shape[-2] == 1 and (new.is_cuda if self.fused is None else self.fused):
            self._check_dtype(new)
            self.settle(wait=False)  # an earlier step's token beyond the range raises here, as at an append
            if self._worst is None or self._worst.device != new.device:
                self._worst = torch.zeros(1, dtype=torch.float32, device=new.device)
            codes, scale, read = append_int8(old[0], old[1], new, self._worst)
            self._held[kind] = (codes, scale)
            if kind == KINDS[-1]:  # the running maximum goes to the host once per step, after the last kind
                self._watch(self._worst[0])
            return read
        self.append(kind, new)
        full = self[kind]
        if self.lossy:
            full[..., -new.shape[-2]:, :] = new  # type: ignore[index]
        return full  # type: ignore[return-value]

    def drop_front(self, kind: str, count: int) -> None:
        """Forget the first ``count`` tokens (a copy: a slice would keep the old storage alive)."""
        held = self._held[kind]
        if held is not None:
            self._held[kind] = tuple(t[..., count:, :].clone() for t in held)

    def select_rows(self, index: torch.Tensor) -> None:
        for kind, held in self._held.items():
            if held is not None:
                self._held[kind] = tuple(t.index_select(0, index.to(t.device)) for t in held)

    def stored(self) -> list[torch.Tensor]:
        """Every tensor held (what :meth:`nbytes` counts)."""
        return [t for held in self._held.values() if held is not None for t in held]

    def nbytes(self) -> int:
        return tensor_bytes(self.stored())

    def bytes_per_token(self, kind: str) -> int:
        """Stored bytes of one token of ``kind`` over every batch row and head."""
        held = self._held[kind]
        return 0 if held is None else sum(t[..., :1, :].numel() * t.element_size() for t in held)

    def settle(self, wait: bool = True) -> None:
        """Raise for a decode step's token beyond the int8 window's range once its largest magnitude reached the host
        (``wait``: wait for every one; the engine does before each flush). Prompts are checked as they arrive; a host
        read per layer and decode step would stop the GPU's stream each time, so those go to the host on their own."""
        while self._watched:
            host, event = self._watched[0]
            if event is not None and not wait and not event.query():
                return
            if event is not None:
                event.synchronize()
            self._watched.pop(0)
            self._refuse(float(host))

    def _watch(self, worst: torch.Tensor) -> None:
        self.settle(wait=False)
        if worst.device.type != "cuda":
            self._watched.append((worst, None))
            return
        host = torch.empty((), dtype=worst.dtype, pin_memory=True)
        host.copy_(worst, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._watched.append((host, event))

    @staticmethod
    def _refuse(worst: float) -> None:
        if worst > _INT8_LIMIT:
            raise ValueError(f"window_storage = 'int8': a token's largest magnitude {worst:.7g} is beyond {_INT8_LIMIT:.7g} "
                             "(127 x the largest float16 scale); use window_storage = 'input'")

    def _check_dtype(self, tensor: torch.Tensor) -> None:
        if self._dtype is None or self._held["keys"] is None and self._held["values"] is None:
            self._dtype = tensor.dtype
        elif tensor.dtype != self._dtype:
            raise ModelError(f"the exact window holds {str(self._dtype).removeprefix('torch.')} tokens; tokens of "
                             f"{str(tensor.dtype).removeprefix('torch.')} arrived (one cache serves one dtype)")

    def _encode(self, tensor: torch.Tensor) -> tuple[torch.Tensor, ...]:
        self._check_dtype(tensor)
        if not self.lossy:
            return (tensor,)
        absmax = tensor.detach().float().abs().amax(dim=-1, keepdim=True)
        finite = torch.isfinite(absmax)
        worst = torch.where(finite, absmax, 0.0).amax()
        if tensor.shape[-2] == 1:  # a decode step: checked without stopping the stream (settle)
            self._watch(worst)
        else:
            self._refuse(float(worst))
        # a vector holding NaN or infinity reads back as NaN, so the engine's check at the flush still names it
        scale = torch.where(finite, absmax / 127, torch.nan).to(torch.float16)
        step = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
        codes = torch.round(tensor.float() / step).clamp_(-127, 127).to(torch.int8)
        return codes, scale


class LayerWindow:
    """One layer's exact (uncompressed) recent tokens, its routed residuals, and its packed-token count."""

    def __init__(self, levels: tuple[int, ...], window_storage: str = "input", slot_bits: bool = True) -> None:
        self.exact = ExactTokens(window_storage)
        self.residuals = {kind: {rank: ResidualList(rank) for rank in levels if rank > 0} for kind in KINDS}
        self.residual_basis: dict[str, torch.Tensor | None] = {kind: None for kind in KINDS}  # [B, H, R, D]
        self.compressed_tokens = 0  # stored (packed) slots per batch row and head
        self.passed_tokens = 0  # logical tokens that left the exact window (stored or dropped)
        self.dropped_tokens = 0  # sliding-window layers: logical tokens no longer held (before the first held one)
        # eviction: the cache index (logical position) of each stored slot, -1 for a filler slot, in the fewer
        # bytes of a list or a bit per passed token (slot_index.SlotIndex; read decoded through ``positions``)
        self.slot_index = SlotIndex(bits=slot_bits)
        # routers that accumulate attention: what every query gave each stored slot, then each exact token
        self.scores: torch.Tensor | None = None  # float32 [B, H, compressed_tokens + exact_tokens]

    @property
    def exact_tokens(self) -> int:
        return self.exact.tokens()

    @property
    def positions(self) -> torch.Tensor | None:
        """int16/int32 [B, H, compressed_tokens]: each stored slot's cache index (-1: filler), decoded for the
        caller; None while the layer never dropped a token."""
        return self.slot_index.positions


class GroupStore:
    """Packed coefficients of one basis group for keys or values, plus the basis state they decode with."""

    def __init__(self) -> None:
        self.state: TensorMap | None = None
        self.coefficients = Segment()
        self.flushes = 0
        self.share = 1.0
        self.next_share: float | None = None
        self.probe_state: dict[str, float] = {}
        self.probe_error: torch.Tensor | None = None
        self.route_state: dict = {}  # the router's per-group state (RouteBlock.state; tensors batch-first)


def select_rows(windows: list[LayerWindow], stores: list[dict[str, GroupStore]], index: torch.Tensor, heads: int) -> None:
    """Keep batch rows ``index`` [B'] (reordering and repeats allowed) of every tensor held in ``windows``
    and ``stores`` (``heads`` KV heads per row in the residual lists)."""
    for window in windows:
        window.exact.select_rows(index)
        for kind in KINDS:
            for residuals in window.residuals[kind].values():
                residuals.select_batch(index, heads)
            if window.residual_basis[kind] is not None:
                window.residual_basis[kind] = window.residual_basis[kind].index_select(0, index.to(window.residual_basis[kind].device))
        window.slot_index.select_rows(index)
        if window.scores is not None:
            window.scores = window.scores.index_select(0, index.to(window.scores.device))
    for group in stores:
        for store in group.values():
            store.coefficients.map(lambda tensor: tensor.index_select(1, index.to(tensor.device)))
            if store.state:
                store.state = {name: t.index_select(0, index.to(t.device)) for name, t in store.state.items()}
            store.route_state.update({
                name: t.index_select(0, index.to(t.device))
                for name, t in store.route_state.items() if isinstance(t, torch.Tensor)
            })
