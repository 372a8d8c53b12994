"""Forward hooks on a model's attention modules, for the scorers that read a forward as it runs
(:mod:`kvweave.engine.importance`, :mod:`kvweave.engine.surrogate`)."""

from __future__ import annotations

from typing import Any

from kvweave.engine.attention import attention_modules, module_queries


class AttentionHooks:
    """A hook (``_hook``) on each of ``modules`` (attention modules) for the duration of a ``with`` block: a forward
    hook ``(module, args, kwargs, output)``, or with ``pre`` a forward pre-hook ``(module, args, kwargs)``."""

    modules: list[Any]
    pre: bool = False

    def __enter__(self) -> AttentionHooks:
        register = "register_forward_pre_hook" if self.pre else "register_forward_hook"
        self.handles = [getattr(m, register)(self._hook, with_kwargs=True) for m in self.modules]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self.handles:
            handle.remove()

    def _hook(self, module: Any, args: tuple, kwargs: dict, *output: Any) -> None:
        raise NotImplementedError


class EnergyTap(AttentionHooks):
    """Forward hooks that record each attention module's queries into ``energy`` (a no-op where it is None)."""

    def __init__(self, model: Any, energy: Any, kv_heads: int) -> None:
        self.modules = attention_modules(model) if energy is not None else []
        self.energy, self.kv_heads = energy, kv_heads

    def _hook(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        self.energy.record(int(module.layer_idx), module_queries(module, hidden, kwargs["position_embeddings"]), self.kv_heads)


class HiddenTap(AttentionHooks):
    """Forward pre-hooks on the attention modules that hand each layer's input hidden states [B, T, D] to ``take``
    (first call per layer only: the context pass, not the repetitions after it)."""

    pre = True

    def __init__(self, model: Any, take: Any) -> None:
        self.modules, self.take, self.seen = attention_modules(model), take, set()

    def _hook(self, module: Any, args: tuple, kwargs: dict, *output: Any) -> None:
        layer = int(module.layer_idx)
        if layer not in self.seen:
            self.seen.add(layer)
            self.take(layer, args[0] if args else kwargs["hidden_states"])
