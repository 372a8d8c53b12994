"""Forward hooks on a model's attention modules, for the scorers that read a forward as it runs
(:mod:`kvweave.engine.importance`, :mod:`kvweave.engine.surrogate`)."""

from __future__ import annotations

from typing import Any

from kvweave.engine.attention import attention_modules, module_queries


class AttentionHooks:
    """A forward hook (``_hook``) on each of ``modules`` (attention modules) for the duration of a ``with`` block."""

    modules: list[Any]

    def __enter__(self) -> AttentionHooks:
        self.handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        raise NotImplementedError


class EnergyTap(AttentionHooks):
    """Forward hooks that record each attention module's queries into ``energy`` (a no-op where it is None)."""

    def __init__(self, model: Any, energy: Any, kv_heads: int) -> None:
        self.modules = attention_modules(model) if energy is not None else []
        self.energy, self.kv_heads = energy, kv_heads

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.energy.record(int(module.layer_idx), module_queries(module, hidden, kwargs["position_embeddings"]), self.kv_heads)


class HiddenTap:
    """Forward pre-hooks on the attention modules that hand each layer's input hidden states [B, T, D] to ``take``
    (first call per layer only: the context pass, not the repetitions after it)."""

    def __init__(self, model: Any, take: Any) -> None:
        self.modules, self.take, self.seen = attention_modules(model), take, set()

    def __enter__(self) -> HiddenTap:
        self.handles = [m.register_forward_pre_hook(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, module: Any, args: tuple, kwargs: dict) -> None:
        layer = int(module.layer_idx)
        if layer not in self.seen:
            self.seen.add(layer)
            self.take(layer, args[0] if args else kwargs["hidden_states"])
