"""A layer's exact window: the recent tokens not (yet) compressed, held as they arrived or as int8 codes with one
scale a vector (:class:`ExactTokens`; ``window_storage``), kept in buffers of a capacity while decode steps replay from
CUDA graphs. :class:`kvweave.engine.store.LayerWindow` holds one.
"""

from __future__ import annotations

from typing import Any

import torch

from kvweave.core.deferred import check
from kvweave.core.errors import CacheStateError, ModelError
from kvweave.core.interfaces import KINDS
from kvweave.core.registry import WINDOW_STORAGE
from kvweave.core.storage import tensor_bytes
from kvweave.kernels.window import append_int8, encode_int8, put_int8

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
        # kept for a CUDA graph (make_static): each kind's held tensors (int8: codes and scales) and read-back in buffers
        # of a capacity, the device's count of the tokens held before a step, and the host's (what the views of _held show)
        self._room: dict[str, tuple[tuple[torch.Tensor, ...], torch.Tensor]] | None = None
        self._fill: torch.Tensor | None = None
        self._count = 0

    @property
    def lossy(self) -> bool:
        """Whether reading returns something other than what arrived (int8 storage)."""
        return self.storage != "input"

    def __getitem__(self, kind: str) -> torch.Tensor | None:
        return self.head(kind)

    def head(self, kind: str, count: int | None = None) -> torch.Tensor | None:
        """The first ``count`` tokens of ``kind`` (all where None) as the attention reads them, decoding only those."""
        held = self._held[kind]
        if held is None:
            return None
        if not self.lossy:
            return held[0] if count is None else held[0][..., :count, :]
        return self.decoded(self.encoded(kind, count))

    def encoded(self, kind: str, count: int | None = None) -> tuple[torch.Tensor, ...]:
        """The first ``count`` tokens of ``kind`` as held: (int8 codes, float32 scales) [..., count, D] and [..., count,
        1], or (tokens,) where the window holds them as they arrived. Gathered or stacked, :meth:`decoded` reads them as
        :meth:`head` would."""
        held = self._held[kind]
        if held is None:
            raise CacheStateError(f"the exact window holds no {kind}")
        return tuple(part if count is None else part[..., :count, :] for part in held)

    def decoded(self, held: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """Tokens in the layout :meth:`encoded` gives, as the attention reads them."""
        if not self.lossy:
            return held[0]
        codes, scale = held  # int8 codes times float32 scales in one pass
        return (codes * scale.float()).to(self._dtype)

    def magnitude(self, kind: str, count: int) -> torch.Tensor:
        """[B, H, count], finite exactly where the first ``count`` tokens of ``kind`` are: an int8 window's scales (NaN
        for a vector holding NaN or infinity), else each vector's largest magnitude."""
        held = self.encoded(kind, count)
        return held[1][..., 0] if self.lossy else torch.linalg.vector_norm(held[0], float("inf"), dim=-1)

    def __setitem__(self, kind: str, tensor: torch.Tensor | None) -> None:
        self._not_static("replaced")
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
        self._not_static("appended to by concatenation")
        encoded = self._encode(new)
        old = self._held[kind]
        self._held[kind] = encoded if old is None else tuple(torch.cat((a, b), dim=-2) for a, b in zip(old, encoded))

    def append_read(self, kind: str, new: torch.Tensor) -> torch.Tensor:
        """Append ``new`` and return ``kind`` as this forward attends over it: the held tokens as read, ``new`` as it
        arrived at its own positions. An int8 window on a GPU takes a decode token by one kernel
        (:func:`kvweave.kernels.window.append_int8`; ``fused`` True forces it, e.g. in Triton's interpreter, False
        never), its largest magnitude checked as :meth:`settle` says."""
        if self._room is not None:
            return self._put(kind, new)
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
        self._not_static("shortened")
        held = self._held[kind]
        if held is not None:
            self._held[kind] = tuple(t[..., count:, :].clone() for t in held)

    def select_rows(self, index: torch.Tensor) -> None:
        self._not_static("reordered")
        for kind, held in self._held.items():
            if held is not None:
                self._held[kind] = tuple(t.index_select(0, index.to(t.device)) for t in held)

    def stored(self) -> list[torch.Tensor]:
        """Every tensor held (what :meth:`nbytes` counts): kept for a CUDA graph, the buffers at their capacity, the
        read-back included."""
        if self._room is not None:  # an unquantized window's read-back is its buffer: counted once
            return [t for buffers, read in self._room.values() for t in (*buffers, *([read] if self.lossy else []))]
        return [t for held in self._held.values() if held is not None for t in held]

    # ------------------------------------------------------------------------- kept for a CUDA graph
    @property
    def static(self) -> bool:
        """Whether the window is kept in buffers of a capacity for a CUDA graph (:meth:`make_static`)."""
        return self._room is not None

    def make_static(self, capacity: int, fill: torch.Tensor) -> None:
        """Keep the window in buffers of ``capacity`` tokens until :meth:`end_static`, so that a decode step's token
        goes in place at the index ``fill`` (int32 [1] on the tokens' device, set by the caller to the tokens held now)
        and reading it back is one buffer: every step launches the same kernels on the same addresses. An int8 window's
        token goes in by :func:`kvweave.kernels.window.put_int8` (a GPU, or Triton's interpreter), which also keeps a
        read-back buffer; a window of the tokens as they arrived is its own read-back. The caller advances ``fill`` and
        :meth:`advance` after each step; nothing else changes the window meanwhile."""
        if self._room is not None:
            raise CacheStateError("the window is kept for a CUDA graph already")
        if any(held is None for held in self._held.values()):
            raise CacheStateError("an empty window cannot be kept for a CUDA graph: feed the prompt first")
        count = self.tokens()
        if capacity <= count:
            raise CacheStateError(f"a window of {count} tokens kept for a CUDA graph needs a capacity above it, not {capacity}")
        if fill.dtype != torch.int32 or fill.shape != (1,) or fill.device != self.device:
            raise CacheStateError(f"the window's fill must be int32 [1] on {self.device}; got {fill.dtype} {tuple(fill.shape)} on {fill.device}")
        room = {}
        for kind, held in self._held.items():
            batch, heads, _, dim = held[0].shape  # type: ignore[index]
            buffers = tuple(t.new_zeros(batch, heads, capacity, t.shape[-1]) for t in held)  # type: ignore[union-attr]
            for buffer, now in zip(buffers, held):  # type: ignore[arg-type]
                buffer[..., :count, :] = now
            read = buffers[0]  # the tokens as they arrived are read as held
            if self.lossy:
                read = torch.zeros(batch, heads, capacity, dim, dtype=self._dtype, device=self.device)
                read[..., :count, :] = self[kind]
            room[kind] = (buffers, read)
        if self.lossy and (self._worst is None or self._worst.device != self.device):
            self._worst = torch.zeros(1, dtype=torch.float32, device=self.device)
        self._room, self._fill, self._count = room, fill, count
        self._show()

    @property
    def fill(self) -> torch.Tensor | None:
        """Kept for a CUDA graph: the device's count of the tokens held before a step (int32 [1]); else None."""
        return self._fill

    def read_buffer(self, kind: str) -> torch.Tensor:
        """Kept for a CUDA graph: ``kind``'s read-back buffer [B, H, capacity, D] (its first ``fill + 1`` rows the window a
        step attends, this step's token as it arrived)."""
        if self._room is None:
            raise CacheStateError("only a window kept for a CUDA graph has a read-back buffer")
        return self._room[kind][1]

    def advance(self, steps: int = 1) -> None:
        """The host's count of a window kept for a CUDA graph moved on by ``steps`` decode tokens (the device's was,
        by the steps themselves)."""
        if self._room is None:
            raise CacheStateError("only a window kept for a CUDA graph advances by count")
        capacity = self._room["keys"][1].shape[-2]
        if self._count + steps > capacity:
            raise CacheStateError(f"a window kept for a CUDA graph holds at most {capacity} tokens; {self._count} + {steps} do not fit")
        self._count += steps
        self._show()

    def end_static(self) -> None:
        """Back to tensors of the window's own length (copies: the buffers are freed); an int8 window's largest
        magnitude over the steps goes to the range check (:meth:`settle`), which a flush waits for."""
        if self._room is None:
            return
        self._held = {kind: tuple(t.clone() for t in held) for kind, held in self._held.items()}  # type: ignore[union-attr]
        self._room = self._fill = None
        if self.lossy and self._worst is not None:
            self._watch(self._worst[0])

    def _show(self) -> None:
        """``_held`` as views of the buffers' first ``_count`` tokens."""
        for kind, (buffers, _) in self._room.items():  # type: ignore[union-attr]
            self._held[kind] = tuple(t[..., :self._count, :] for t in buffers)

    def _put(self, kind: str, new: torch.Tensor) -> torch.Tensor:
        """A decode token of a window kept for a CUDA graph, in place: the read-back buffer (its first fill + 1 rows)."""
        if new.shape[-2] != 1:
            raise CacheStateError(f"a window kept for a CUDA graph takes one decode token a step, not {new.shape[-2]}")
        self._check_dtype(new)
        buffers, read = self._room[kind]  # type: ignore[index]
        if self.lossy and (new.is_cuda if self.fused is None else self.fused):
            put_int8(*buffers, read, new, self._fill, self._worst)  # type: ignore[arg-type]
        elif self.lossy:  # off a GPU: the kernel's arithmetic in torch (Triton runs there only in its interpreter)
            self._put_torch(buffers, read, new)  # type: ignore[arg-type]
        else:
            read.index_copy_(2, self._fill.long(), new)  # type: ignore[union-attr]
        return read

    def _put_torch(self, buffers: tuple[torch.Tensor, ...], read: torch.Tensor, new: torch.Tensor) -> None:
        """:func:`kvweave.kernels.window.put_int8` in torch, at the index the fill holds: the token before it in
        ``read`` replaced by its read-back, the new token encoded (a vector holding NaN or infinity: zero codes, a NaN
        scale) and written to ``read`` as it arrived, its largest finite magnitude raised into ``_worst``."""
        codes_buffer, scale_buffer = buffers
        at = int(self._fill)  # type: ignore[arg-type]
        if at > 0:
            before = codes_buffer[..., at - 1 : at, :].float() * scale_buffer[..., at - 1 : at, :].float()
            read[..., at - 1 : at, :] = before.to(read.dtype)
        x = new.float()
        finite = torch.isfinite(x).all(dim=-1, keepdim=True)
        absmax = torch.where(torch.isfinite(x), x.abs(), 0.0).amax(dim=-1, keepdim=True)
        scale = torch.where(finite, absmax / 127, torch.nan).to(torch.float16)
        step = torch.where(scale.float() > 0, scale.float(), 1.0)
        codes = torch.where(finite, torch.round((x / step).clamp(-127, 127)), 0.0)
        codes_buffer[..., at : at + 1, :] = codes.to(torch.int8)
        scale_buffer[..., at : at + 1, :] = scale
        read[..., at : at + 1, :] = new
        torch.maximum(self._worst, torch.where(finite, absmax, 0.0).amax().reshape(1), out=self._worst)  # type: ignore[arg-type]

    def _not_static(self, what: str) -> None:
        if self._room is not None:
            raise CacheStateError(f"the exact window is kept for a CUDA graph and cannot be {what}; end the graph's "
                                  "steps first (end_static)")

    def nbytes(self) -> int:
        return tensor_bytes(self.stored())

    def bytes_per_token(self, kind: str) -> int:
        """Stored bytes of one token of ``kind`` over every batch row and head."""
        held = self._held[kind]
        return 0 if held is None else sum(t[..., :1, :].numel() * t.element_size() for t in held)

    def settle(self, wait: bool = True) -> None:
        """Raise for a decode step's token beyond the int8 window's range once its largest magnitude reached the host
        (``wait``: wait for every one; the engine does before each flush). Prompts are checked as they arrive, or with the
        forward's other checks where the engine defers them (:mod:`kvweave.core.deferred`); a host read per layer and
        decode step would stop the GPU's stream each time, so those go to the host on their own."""
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
        if tensor.dim() == 4 and tensor.shape[-2] > 1 and (tensor.is_cuda if self.fused is None else self.fused):
            worst = torch.zeros(1, dtype=torch.float32, device=tensor.device)  # a prompt by one kernel, as below
            codes, scale = encode_int8(tensor.detach(), worst)
            check(worst[0] > _INT8_LIMIT, lambda: self._refuse(float(worst[0])))  # with the forward's checks
            return codes, scale
        absmax = tensor.detach().float().abs().amax(dim=-1, keepdim=True)
        finite = torch.isfinite(absmax)
        worst = torch.where(finite, absmax, 0.0).amax()
        if tensor.shape[-2] == 1:  # a decode step: checked without stopping the stream (settle)
            self._watch(worst)
        else:  # a prompt: with the forward's checks
            check(worst > _INT8_LIMIT, lambda: self._refuse(float(worst)))
        # a vector holding NaN or infinity reads back as NaN, so the engine's check at the flush still names it
        scale = torch.where(finite, absmax / 127, torch.nan).to(torch.float16)
        step = torch.where(scale > 0, scale.float(), torch.ones_like(absmax))
        codes = torch.round(tensor.float() / step).clamp_(-127, 127).to(torch.int8)
        return codes, scale
