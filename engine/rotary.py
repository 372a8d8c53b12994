"""Key storage before the rotary embedding (``key_space = "pre-rope"``).

Keys reach the cache after the model's rotary embedding (RoPE): ``k_post = s * R(theta_p) k`` with a
rotation per channel pair and the model's attention scaling ``s`` (1 for most models). Rotated keys mix
each channel pair differently at every position, which spreads the per-channel structure that makes
keys compressible (KVQuant, Hooper et al. 2024, arXiv:2401.18079, Sec. 3.2: per-channel quantization
before RoPE). With ``key_space = "pre-rope"`` the engine un-rotates each key block when it leaves the
exact window, compresses it, and rotates the decoded keys back where attention reads them.

Positions: a key is un-rotated and re-rotated at its *cache index* (its logical position in the cache,
0 for the first token of every row). For rows without left padding that is the model's position, so the
stored keys are exactly the pre-RoPE keys; for a left-padded row it differs by the row's padding, so its
stored keys carry one fixed rotation per row, the same for all its tokens, which keeps the per-channel
statistics a quantizer relies on. Either way the round trip is exact to float rounding: the same angles
rotate back what they rotated forward.

The angles come from the model's own rotary module (``model.model.rotary_emb`` or any submodule named
``rotary_emb``), called for the cache indices, so any RoPE variant that does not depend on the sequence
length (default, linear, llama3, yarn) inverts exactly. Models without one, with partial rotary
dimensions, or with length-dependent variants (dynamic NTK, longrope) are refused with a ``ModelError``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from kvweave.core.errors import CacheStateError, ModelError

#: RoPE variants whose angles depend only on the position (not on the sequence length seen so far)
INVERTIBLE_ROPE = ("default", "linear", "llama3", "yarn", "proportional")


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryInverse:
    """Un-rotates and re-rotates keys [..., n, D] at given cache indices with a model's rotary module."""

    def __init__(self, module: Any, head_dim: int, layer_types: list[str] | None, where: str) -> None:
        self.module = module
        self.head_dim = head_dim
        self.layer_types = layer_types
        self.takes_layer_type = "layer_type" in inspect.signature(module.forward).parameters
        self.where = where

    @classmethod
    def from_model(cls, model: Any, head_dim: int, where: str) -> RotaryInverse:
        """The inverse of ``model``'s rotary embedding; ``ModelError`` (naming ``where``) when it has none
        kvweave can invert."""
        config = model.config
        text = getattr(config, "get_text_config", lambda: config)()
        if float(getattr(text, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ModelError(f"{where}: key_space 'pre-rope' needs a rotary embedding over the whole head dim; "
                             f"{text.model_type} rotates {text.partial_rotary_factor} of it. Use key_space 'post-rope'")
        module = next((m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_emb"), None)
        if module is None or not hasattr(module, "forward"):
            raise ModelError(f"{where}: key_space 'pre-rope' needs the model's rotary embedding (a module named "
                             f"'rotary_emb'); {type(model).__name__} has none. Use key_space 'post-rope'")
        declared = getattr(module, "rope_type", "default")  # one name, or one per layer type (Gemma 3)
        kinds = set(declared.values()) if isinstance(declared, dict) else {declared}
        bad = sorted(str(kind) for kind in kinds if kind not in INVERTIBLE_ROPE)
        if bad:
            raise ModelError(f"{where}: key_space 'pre-rope' cannot invert rotary embedding type {bad} (its angles "
                             f"depend on the sequence length); invertible: {', '.join(INVERTIBLE_ROPE)}. Use key_space 'post-rope'")
        inverse = cls(module, head_dim, list(getattr(text, "layer_types", None) or []) or None, where)
        inverse.check()
        return inverse

    def angles(self, layer: int, positions: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [*positions.shape, D] (float32, the attention scaling included) at ``positions``."""
        flat = positions.reshape(1, -1).to(device=device, dtype=torch.long)
        probe = torch.zeros(1, device=device, dtype=torch.float32)
        args: tuple = (probe, flat)
        if self.takes_layer_type:
            if self.layer_types is None:
                raise ModelError(f"{self.where}: the rotary embedding needs a layer type, the config lists none")
            args = (*args, self.layer_types[layer])
        with torch.no_grad():
            cos, sin = self.module(*args)
        if cos.shape[-1] != self.head_dim:
            raise ModelError(f"{self.where}: the rotary embedding covers {cos.shape[-1]} of {self.head_dim} head "
                             "channels; key_space 'pre-rope' needs all of them. Use key_space 'post-rope'")
        shape = (*positions.shape, self.head_dim)
        return cos.float().reshape(shape), sin.float().reshape(shape)

    def frequencies(self, layer: int) -> tuple[torch.Tensor, float]:
        """``(inv_freq float32 [D / 2], scale)``: the angles ``position * inv_freq`` and the factor on cos and
        sin that :meth:`angles` gives at ``layer`` (what a kernel rotates keys with in registers); checked
        against the module's own cos and sin, ``ModelError`` when they differ."""
        kind = self.layer_types[layer] if self.takes_layer_type and self.layer_types else None
        prefix = f"{kind}_" if kind is not None and hasattr(self.module, f"{kind}_inv_freq") else ""
        inv_freq = getattr(self.module, f"{prefix}inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor) or inv_freq.numel() * 2 != self.head_dim:
            raise ModelError(f"{self.where}: the model's rotary embedding has no inv_freq of {self.head_dim // 2} angles "
                             "to rotate keys with; use kernel 'reference'")
        scale = float(getattr(self.module, f"{prefix}attention_scaling", 1.0) or 1.0)
        inv_freq = inv_freq.detach().float()
        positions = torch.tensor([0, 1, 7, 97, 4093], device=inv_freq.device)
        cos, sin = self.angles(layer, positions, inv_freq.device)
        angle = positions[:, None].float() * inv_freq[None, :]
        mine = torch.cat((angle.cos(), angle.cos()), -1) * scale, torch.cat((angle.sin(), angle.sin()), -1) * scale
        if not (torch.allclose(mine[0], cos, atol=1e-4) and torch.allclose(mine[1], sin, atol=1e-4)):
            raise ModelError(f"{self.where}: the model's rotary angles are not position * inv_freq; use kernel 'reference'")
        return inv_freq, scale

    def unrotate(self, keys: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``keys`` [..., n, D] at cache indices ``positions`` (broadcast to [..., n]) -> pre-RoPE,
        in float32 (float64 for float64 keys)."""
        cos, sin = self.angles(layer, positions, keys.device)
        x = keys.to(_work_dtype(keys))
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        norm = cos * cos + sin * sin  # the attention scaling squared
        return (x * cos - _rotate_half(x) * sin) / norm

    def rotate(self, keys: torch.Tensor, layer: int, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``keys`` [..., n, D] -> post-RoPE at cache indices ``positions``, in ``keys``' dtype."""
        cos, sin = self.angles(layer, positions, keys.device)
        x = keys.to(_work_dtype(keys))
        return (x * cos.to(x.dtype) + _rotate_half(x) * sin.to(x.dtype)).to(keys.dtype)

    def check(self) -> None:
        """Refuse a rotary module whose rotation does not invert (checked once, on random keys)."""
        generator = torch.Generator().manual_seed(0)
        keys = torch.randn(2, 7, self.head_dim, generator=generator)
        positions = torch.arange(7) * 97
        device = next((b.device for b in self.module.buffers()), torch.device("cpu"))
        back = self.unrotate(self.rotate(keys.to(device), 0, positions), 0, positions).cpu()
        if not torch.allclose(back, keys, atol=1e-4, rtol=1e-4):
            raise ModelError(f"{self.where}: the model's rotary embedding does not invert exactly "
                             f"(largest error {float((back - keys).abs().max()):.2e}); use key_space 'post-rope'")


def turn_keys(rotary: RotaryInverse | None, where: str, keys: torch.Tensor, members: tuple[int, ...],
              positions: torch.Tensor | None, inverse: bool) -> torch.Tensor:
    """Keys [G, B, H, n, D] of the layers ``members`` un-rotated (``inverse``) or rotated by ``rotary`` at cache indices
    ``positions`` (broadcast to [G, B, H, n]); float32 (float64 kept). ``where`` names the pipeline in errors."""
    if rotary is None:
        raise CacheStateError(
            f"{where} stores keys before the rotary embedding (key_space 'pre-rope'), which needs the model's rotary "
            "module: build the cache with build_cache(pipeline, model)"
        )
    if positions is None:
        raise CacheStateError(f"{where}: a key block reached the encoder without its positions")
    if positions.dim() == 1:  # the same positions in every row and head: angles for those alone, broadcast
        at = [positions] * len(members)
    else:
        at = list(positions.expand(keys.shape[:-1]) if positions.dim() < 4 else positions)
    turn = rotary.unrotate if inverse else rotary.rotate
    turned = [turn(keys[m] if keys.dtype == torch.float64 else keys[m].float(), layer, at[m]) for m, layer in enumerate(members)]
    return turned[0].unsqueeze(0) if len(turned) == 1 else torch.stack(turned)
