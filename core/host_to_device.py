"""Small tensors made on the host and used on a GPU, sent without stopping the host.

A tensor copied from ordinary (pageable) host memory to a GPU, as ``torch.tensor(values, device="cuda")`` or
``.to("cuda")`` do, makes the host wait for every kernel queued before the copy. A prompt's flush runs inside the
model's forward, with the forward's next layers queued ahead of it; a wait there holds the flush's own work back until
the GPU has caught up, and the GPU then idles while the host issues it. Copied from pinned memory without blocking,
the copy takes its place in the queue and the host goes on.

- :func:`send`: a host tensor on ``device``, through pinned memory where ``device`` is a GPU;
- :func:`device_constant`: a tuple of numbers as a tensor on ``device``, made once per (numbers, dtype, device);
- :func:`on_device`: a small host tensor of constants on ``device`` through :func:`device_constant`.
"""

from __future__ import annotations

import functools

from kvweave.core.lazy import torch


def send(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``; to a GPU from pinned memory, the host not waiting for the queue (the
    pinned buffer is held until the copy has run)."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


@functools.lru_cache(maxsize=256)
def _constant(values: tuple, dtype: torch.dtype, device: str) -> torch.Tensor:
    return send(torch.tensor(values, dtype=dtype), device)


def device_constant(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` (numbers) as a 1-d ``dtype`` tensor on ``device``, made once and shared: read-only."""
    return _constant(tuple(values), dtype, str(device))


def on_device(values: torch.Tensor | None, device: torch.device | str) -> torch.Tensor | None:
    """A small host tensor of constants (a router's residual gates) on ``device``: for the same numbers the same tensor,
    made once (a CUDA graph replays the address it captured; a kernel cannot read host memory); a tensor on a device
    already, or on the host for a host ``device``, as it is; None stays None."""
    if values is None or values.device.type != "cpu" or torch.device(device).type == "cpu":
        return values
    made = device_constant(values.flatten().tolist(), values.dtype, device)
    return made if values.dim() == 1 else made.view(values.shape)
