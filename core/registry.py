"""registry.toml: named pipelines, one component per slot, with ``extends`` inheritance.

Format::

    [pipelines.int4]
    description = "4-bit per-token keys and values, exact recent window"
    extends = "full"            # optional: start from another pipeline
    recent_window = 128         # pipeline settings (see StorageSettings)
    [pipelines.int4.quantizer]  # a slot: 'use' names a registered component, other keys are its parameters
    use = "int4-group"
    group = 32

A child slot with ``use`` replaces the parent's slot wholly; a child slot without ``use`` overrides
only the parameters it names. Every pipeline is resolved and validated (components exist, parameters
are accepted) before any model is loaded. A user's registry file is read on top of the built-in one:
its pipelines may extend the built-in pipelines but not redefine them.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs

from kvweave.core import plugins
from kvweave.core.errors import ComponentError, RegistryError
from kvweave.core.groups import DEFAULT_SLOTS, KIND_SLOTS, SLOT_GROUPS
from kvweave.core.interfaces import KINDS, Component
from kvweave.core.params import choice, integer
from kvweave.core.precision import PRODUCTS

BUILTIN_REGISTRY = Path(__file__).with_name("registry.toml").resolve()
PIPELINE_KEYS = ("description", "extends")


#: ``window_storage`` choices: the uncompressed tokens as they arrive, or int8 per token and head
WINDOW_STORAGE = ("input", "int8")


@attrs.frozen
class StorageSettings:
    """Pipeline-level settings of the compressed cache."""

    recent_window: int = attrs.field(
        default=128, validator=integer(0), metadata={"doc": "most recent tokens kept exact (not compressed)"}
    )
    block_tokens: int = attrs.field(
        default=64, validator=integer(1), metadata={"doc": "tokens compressed together once they leave the window"}
    )
    compress: bool = attrs.field(
        default=True, metadata={"doc": "false keeps every token exact (the 'full' pipeline)"}
    )
    residual_mode: str = attrs.field(
        default="channels", validator=choice(("channels", "basis")),
        metadata={"doc": "residual of rank rho: the rho largest channels (+ indices), or rho coordinates on a per-layer residual basis"},
    )
    key_space: str = attrs.field(
        default="post-rope", validator=choice(("post-rope", "pre-rope")),
        metadata={"doc": "store keys as the model computed them, or before its rotary embedding (un-rotated when they leave the exact window, rotated back where attention reads them)"},
    )
    sliding_layers: str = attrs.field(
        default="exact", validator=choice(("exact", "compress")),
        metadata={"doc": "sliding-window layers: keep their window exactly as the model's own cache does, or compress it like the other layers (blocks wholly out of the window are dropped)"},
    )
    sliding_tokens: int = attrs.field(
        default=0, validator=integer(0),
        metadata={"doc": "sliding-window layers: 0 keeps what their window holds (window - 1 tokens); N keeps only their last N tokens, a shorter window than the model's (older blocks dropped whole when compressed)"},
    )
    window_storage: str = attrs.field(
        default="input", validator=choice(WINDOW_STORAGE),
        metadata={"doc": "tokens held uncompressed (recent window, the block not yet full, kept sliding windows): as they arrive, or int8 per token and head with a float16 scale (D + 2 bytes a vector)"},
    )
    observe_queries: int = attrs.field(
        default=16, validator=integer(1, 4096),
        metadata={"doc": "recent queries per layer kept for attention features and probes (when used)"},
    )
    products: str = attrs.field(
        default="float32", validator=choice(PRODUCTS),
        metadata={"doc": "float32 matrix products of a block's storage (bases, residual fit, probe) on a CUDA GPU: exact, or on TF32 tensor cores (faster first token; moves the stored bases by a fraction of a degree)"},
    )

    @compress.validator
    def _boolean(self, attribute: attrs.Attribute, value: Any) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"'compress' must be true or false, got {value!r}")


SETTING_KEYS = tuple(field.name for field in attrs.fields(StorageSettings))


@attrs.frozen
class SlotConfig:
    """One slot of a resolved pipeline: the component, its parameters, who provides it."""

    use: str
    params: dict[str, Any]
    component: Component
    plugin: str
    distribution: str


@attrs.frozen
class ResolvedPipeline:
    """A pipeline with inheritance applied and every component built and validated."""

    name: str
    description: str
    chain: tuple[str, ...]
    source: str
    settings: StorageSettings
    slots: dict[str, SlotConfig]

    def component(self, slot: str) -> Component:
        """The component of ``slot`` (``"quantizer"``, or a kind's own ``"keys.quantizer"``)."""
        return self.slots[slot].component

    def component_for(self, slot: str, kind: str) -> Component:
        """The component ``kind`` ("keys"/"values") uses in ``slot``: its own when the pipeline names one
        (``[pipelines.NAME.keys.quantizer]``), else the shared one."""
        return self.slots[self.slot_for(slot, kind)].component

    def slot_for(self, slot: str, kind: str) -> str:
        """The slot name ``kind`` takes ``slot`` from (``"keys.quantizer"`` or ``"quantizer"``)."""
        own = f"{kind}.{slot}"
        return own if own in self.slots else slot

    def use(self, slot: str) -> str:
        """The registered name in ``slot``."""
        return self.slots[slot].use

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "description": self.description,
            "extends_chain": list(self.chain),
            "source": self.source,
            "settings": attrs.asdict(self.settings),
            "slots": {
                slot: {"use": cfg.use, "params": _effective_params(cfg), "plugin": cfg.plugin, "distribution": cfg.distribution}
                for slot, cfg in self.slots.items()
            },
        }


def _effective_params(cfg: SlotConfig) -> dict[str, Any]:
    """Every parameter of the slot's component, defaults included."""
    return {field.alias: getattr(cfg.component, field.name) for field in attrs.fields(type(cfg.component)) if field.init}


@attrs.define
class Registry:
    """Raw pipeline tables by name, with the file each came from."""

    tables: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    sources: dict[str, str] = attrs.field(factory=dict)

    def names(self) -> list[str]:
        return list(self.tables)

    def add_file(self, path: Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise RegistryError(f"registry file {path} does not exist")
        try:
            data = tomllib.loads(path.read_text(encoding="utf-8"))
        except tomllib.TOMLDecodeError as exc:
            raise RegistryError(f"registry {path} is not valid TOML: {exc}") from exc
        unknown = sorted(set(data) - {"pipelines"})
        if unknown:
            raise RegistryError(f"registry {path}: unknown top-level table(s) {unknown}; only [pipelines.NAME] tables are accepted")
        pipelines = data.get("pipelines", {})
        if not isinstance(pipelines, dict) or not pipelines:
            raise RegistryError(f"registry {path} defines no pipelines; add a [pipelines.NAME] table")
        for name, table in pipelines.items():
            if not isinstance(table, dict):
                raise RegistryError(f"registry {path}: 'pipelines.{name}' must be a table, got {type(table).__name__}")
            if name in self.tables:
                raise RegistryError(
                    f"registry {path}: pipeline '{name}' is already defined in {self.sources[name]}; "
                    f"give it another name and use extends = \"{name}\" to build on it"
                )
            self.tables[name] = table
            self.sources[name] = str(path)

    def resolve(self, name: str) -> ResolvedPipeline:
        merged, chain = self._merge(name, ())
        where = f"registry {self.sources[name]}, pipeline '{name}'"
        settings_raw = {key: merged[key] for key in SETTING_KEYS if key in merged}
        try:
            settings = StorageSettings(**settings_raw)
        except (TypeError, ValueError) as exc:
            raise RegistryError(f"{where}: {exc}") from exc
        catalog = plugins.catalog()
        slots: dict[str, SlotConfig] = {}
        for slot, group in SLOT_GROUPS.items():
            table = merged.get(slot)
            if table is None and slot in DEFAULT_SLOTS:
                table = {"use": DEFAULT_SLOTS[slot]}
            slots[slot] = self._build_slot(where, name, slot, group, table, catalog)
        for kind in KINDS:
            for slot, table in merged.get(kind, {}).items():
                slots[f"{kind}.{slot}"] = self._build_slot(where, name, f"{kind}.{slot}", SLOT_GROUPS[slot], table, catalog)
        description = merged.get("description", f"extends {chain[1]}" if len(chain) > 1 else "")
        pipeline = ResolvedPipeline(name, description, chain, self.sources[name], settings, slots)
        kernel = slots["kernel"]
        if settings.key_space == "pre-rope" and not (kernel.component.materializes or kernel.component.pre_rope_keys):
            raise RegistryError(
                f"{where}: setting key_space = 'pre-rope' stores keys before the rotary embedding, but slot 'kernel' "
                f"('{kernel.use}') reads stored keys in place without rotating them; use kernel 'reference' or "
                "key_space 'post-rope'"
            )
        if settings.sliding_layers == "compress" and not kernel.component.materializes:
            raise RegistryError(
                f"{where}: setting sliding_layers = 'compress' drops the blocks that leave a sliding window, which slot "
                f"'kernel' ('{kernel.use}') cannot follow (it reads stored tokens from position 0); use kernel "
                "'reference' or sliding_layers 'exact'"
            )
        for slot, config in slots.items():  # what two slots must agree on, checked before any model is loaded
            try:
                config.component.check_pipeline(pipeline, slot)
            except (ComponentError, ValueError) as exc:
                message = str(exc)
                prefix = f"registry {self.sources[name]}" if message.startswith(f"pipeline '{name}'") else where
                raise RegistryError(f"{prefix}: {message}") from exc
        return pipeline

    @staticmethod
    def _build_slot(where: str, name: str, slot: str, group: str, table: Any, catalog: Any) -> SlotConfig:
        """Build the component of one slot table (``use`` + parameters)."""
        if table is None or "use" not in table:
            raise RegistryError(
                f"{where}: slot '{slot}' has no component; add [pipelines.{name}.{slot}] with use = one of: "
                f"{', '.join(sorted(catalog.components[group]))}"
            )
        use = table["use"]
        if not isinstance(use, str):
            raise RegistryError(f"{where}, slot '{slot}': 'use' must be a component name (a string), got {use!r}")
        params = {key: value for key, value in table.items() if key != "use"}
        slot_where = f"{where}, slot '{slot}'"
        try:
            info = catalog.get(group, use)
        except ComponentError as exc:
            raise RegistryError(f"{slot_where}: {exc}") from exc
        try:
            component = plugins.build_component(info, params, slot_where)
        except ComponentError as exc:
            raise RegistryError(str(exc)) from exc
        return SlotConfig(use, params, component, info.plugin, info.distribution)

    def _merge(self, name: str, stack: tuple[str, ...]) -> tuple[dict[str, Any], tuple[str, ...]]:
        if name in stack:
            cycle = " -> ".join((*stack, name))
            raise RegistryError(f"registry {self.sources[stack[0]]}: 'extends' forms a cycle: {cycle}")
        if name not in self.tables:
            referrer = f"pipeline '{stack[-1]}' extends unknown pipeline" if stack else "unknown pipeline"
            raise RegistryError(f"{referrer} '{name}'; defined pipelines: {', '.join(sorted(self.tables))}")
        table = self.tables[name]
        where = f"registry {self.sources[name]}, pipeline '{name}'"
        accepted = (*PIPELINE_KEYS, *SETTING_KEYS, *SLOT_GROUPS, *KINDS)
        for key, value in table.items():
            if key not in accepted:
                raise RegistryError(
                    f"{where}: unknown key '{key}'; accepted keys: settings {', '.join(SETTING_KEYS)}, "
                    f"{', '.join(PIPELINE_KEYS)}, slot tables {', '.join(SLOT_GROUPS)}, and per-kind tables "
                    f"{' and '.join(KINDS)} (holding {', '.join(KIND_SLOTS)})"
                )
            if key in SLOT_GROUPS and not isinstance(value, dict):
                raise RegistryError(f"{where}: slot '{key}' must be a table ([pipelines.{name}.{key}]), got {value!r}")
            if key in KINDS:
                if not isinstance(value, dict):
                    raise RegistryError(f"{where}: '{key}' must be a table of slot tables ([pipelines.{name}.{key}.quantizer]), got {value!r}")
                for slot, inner in value.items():
                    if slot not in KIND_SLOTS:
                        raise RegistryError(
                            f"{where}: '{key}.{slot}' is not a slot that may differ between keys and values; "
                            f"those are {', '.join(KIND_SLOTS)}"
                        )
                    if not isinstance(inner, dict):
                        raise RegistryError(f"{where}: slot '{key}.{slot}' must be a table ([pipelines.{name}.{key}.{slot}]), got {inner!r}")
        for key in PIPELINE_KEYS:
            if key in table and not isinstance(table[key], str):
                raise RegistryError(f"{where}: '{key}' must be a string, got {table[key]!r}")
        parent_name = table.get("extends")
        if parent_name is None:
            merged: dict[str, Any] = {}
            chain: tuple[str, ...] = (name,)
        else:
            merged, parent_chain = self._merge(parent_name, (*stack, name))
            chain = (name, *parent_chain)
        for key, value in table.items():
            if key == "extends":
                continue
            if key in SLOT_GROUPS:
                merged[key] = _merge_slot(merged.get(key), value, f"{where}: slot '{key}'")
            elif key in KINDS:
                kinds = dict(merged.get(key, {}))
                for slot, inner in value.items():
                    kinds[slot] = _merge_slot(kinds.get(slot), inner, f"{where}: slot '{key}.{slot}'")
                merged[key] = kinds
            else:
                merged[key] = value
        return merged, chain

    def resolve_all(self) -> list[ResolvedPipeline]:
        return [self.resolve(name) for name in self.tables]


def _merge_slot(parent: dict[str, Any] | None, child: dict[str, Any], where: str) -> dict[str, Any]:
    """A child slot table with ``use`` replaces the parent's wholly; without, it overrides parameters."""
    if "use" in child:
        return dict(child)
    if parent is None:
        raise RegistryError(f"{where} overrides parameters but no parent defines that slot; add 'use'")
    return {**parent, **child}


def load_registry(path: str | Path | None = None) -> Registry:
    """The built-in registry, with the pipelines of ``path`` (a user's file) added on top."""
    registry = Registry()
    registry.add_file(BUILTIN_REGISTRY)
    if path is not None:
        registry.add_file(Path(path))
    return registry


def load_pipeline(name: str, registry: str | Path | Registry | None = None) -> ResolvedPipeline:
    """Resolve pipeline ``name`` from the built-in registry (plus a user file, or a given Registry)."""
    if not isinstance(registry, Registry):
        registry = load_registry(registry)
    return registry.resolve(name)
