"""Plugin discovery: entry points of the ``kvweave`` group, registered into one pluggy manager.

Built-in components are plugins like any other: kvweave's own distribution lists its plugin modules
under ``[project.entry-points.kvweave]``. A plugin that fails to import or whose hooks are invalid is
reported (naming its entry point and distribution) and skipped; the others still load. Set
``KVWEAVE_DISABLE_PLUGINS=name1,name2`` to skip plugins by entry-point name.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from typing import Any, Iterator

import attrs
import pluggy

from kvweave.core import hookspecs
from kvweave.core.errors import ComponentError, PluginError
from kvweave.core.groups import GROUP_INTERFACES
from kvweave.core.interfaces import Component

ENTRY_POINT_GROUP = "kvweave"
DISABLE_ENV = "KVWEAVE_DISABLE_PLUGINS"
HOOK_FOR_GROUP = {group: f"kvweave_register_{group}" for group in GROUP_INTERFACES}


@attrs.frozen
class PluginInfo:
    """One plugin: its entry-point name, distribution, version and the hooks it implements."""

    name: str
    distribution: str
    version: str
    hooks: tuple[str, ...]


@attrs.frozen
class PluginFailure:
    """A plugin that could not be loaded, and why."""

    name: str
    distribution: str
    error: str


@attrs.frozen
class ComponentInfo:
    """A registered component: its group, name, factory class and the plugin that provides it."""

    group: str
    name: str
    factory: type
    plugin: str
    distribution: str


class Registrar:
    """Handed to a registration hook; ``add(name, factory)`` registers one component of ``group``."""

    def __init__(self, catalog: Catalog, group: str, plugin: PluginInfo) -> None:
        self._catalog = catalog
        self.group = group
        self.plugin = plugin

    def add(self, name: str, factory: type) -> None:
        """Register ``factory`` (an attrs class implementing the group's interface) under ``name``."""
        interface = GROUP_INTERFACES[self.group]
        where = f"plugin '{self.plugin.name}' (distribution {self.plugin.distribution})"
        if not isinstance(name, str) or not name:
            raise PluginError(f"{where} registered a {self.group} component with an invalid name {name!r}")
        if not (isinstance(factory, type) and issubclass(factory, interface)):
            raise PluginError(
                f"{where} registered {self.group} component '{name}' as {factory!r}, which is not a subclass "
                f"of {interface.__module__}.{interface.__qualname__}"
            )
        if not attrs.has(factory):
            raise PluginError(
                f"{where} registered {self.group} component '{name}' as {factory.__qualname__}, which is not an "
                "attrs class; decorate it with @attrs.frozen so its fields are its parameters"
            )
        existing = self._catalog.components[self.group].get(name)
        if existing is not None:
            raise PluginError(
                f"duplicate {self.group} component '{name}': registered by plugin '{existing.plugin}' "
                f"(distribution {existing.distribution}) and again by {where}. Component names must be unique; "
                f"rename one of them, or disable a plugin with {DISABLE_ENV}=<plugin name>"
            )
        self._catalog.components[self.group][name] = ComponentInfo(
            self.group, name, factory, self.plugin.name, self.plugin.distribution
        )


@attrs.define
class Catalog:
    """Everything the installed plugins provide."""

    plugins: list[PluginInfo] = attrs.field(factory=list)
    failures: list[PluginFailure] = attrs.field(factory=list)
    components: dict[str, dict[str, ComponentInfo]] = attrs.field(
        factory=lambda: {group: {} for group in GROUP_INTERFACES}
    )

    def get(self, group: str, name: str) -> ComponentInfo:
        """The component ``name`` of ``group``, or a :class:`ComponentError` listing what is available."""
        if group not in self.components:
            raise ComponentError(f"unknown component group '{group}'; groups are: {', '.join(self.components)}")
        found = self.components[group].get(name)
        if found is None:
            available = ", ".join(sorted(self.components[group])) or "(none)"
            message = f"unknown {group} component '{name}'; available: {available}"
            if self.failures:
                failed = ", ".join(f"{f.name} ({f.distribution})" for f in self.failures)
                message += f". Plugins that failed to load (run 'kvweave plugins'): {failed}"
            raise ComponentError(message)
        return found

    def iter_components(self, group: str | None = None) -> Iterator[ComponentInfo]:
        for group_name, table in self.components.items():
            if group is None or group == group_name:
                yield from (table[name] for name in sorted(table))


def _disabled() -> set[str]:
    return {name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()}


def _distribution_of(entry_point: importlib.metadata.EntryPoint) -> tuple[str, str]:
    dist = getattr(entry_point, "dist", None)
    if dist is None:
        return "unknown", "unknown"
    return dist.metadata["Name"], dist.version


class PluginHost:
    """The pluggy manager plus the catalog of components it collected."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.manager.add_hookspecs(hookspecs)
        self._info: dict[str, PluginInfo] = {}
        self.failures: list[PluginFailure] = []

    def load_entry_points(self) -> None:
        disabled = _disabled()
        for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if entry_point.name in disabled or entry_point.name in self._info:
                continue
            dist_name, version = _distribution_of(entry_point)
            try:
                plugin = entry_point.load()
            except Exception as exc:  # a broken third-party plugin must not stop the others
                self._fail(entry_point.name, dist_name, f"import of '{entry_point.value}' failed: {exc!r}")
                continue
            self.register(plugin, entry_point.name, dist_name, version)

    def register(self, plugin: Any, name: str, distribution: str = "unknown", version: str = "unknown") -> None:
        """Register one plugin object; invalid hooks make it a reported failure instead."""
        try:
            self.manager.register(plugin, name=name)
            self.manager.check_pending()
        except Exception as exc:
            if self.manager.is_registered(plugin):
                self.manager.unregister(plugin)
            self._fail(name, distribution, f"invalid hooks: {exc}")
            return
        hooks = tuple(sorted(impl_name for impl_name in dir(plugin) if impl_name.startswith("kvweave_")))
        self._info[name] = PluginInfo(name, distribution, version, hooks)

    def unregister(self, name: str) -> None:
        plugin = self.manager.get_plugin(name)
        if plugin is not None:
            self.manager.unregister(plugin)
        self._info.pop(name, None)

    def _fail(self, name: str, distribution: str, error: str) -> None:
        self.failures.append(PluginFailure(name, distribution, error))
        warnings.warn(f"kvweave plugin '{name}' (distribution {distribution}) was skipped: {error}", stacklevel=3)

    def collect(self) -> Catalog:
        """Call every plugin's registration hooks and return what they registered.

        A plugin whose hook raises is dropped whole: its components from earlier hooks are removed and
        its later hooks are not called. A duplicate name or a non-component (:class:`PluginError`) is
        an error of the installation and propagates."""
        catalog = Catalog(failures=list(self.failures))
        crashed: set[str] = set()
        for group, hook_name in HOOK_FOR_GROUP.items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                plugin = self._info[impl.plugin_name]
                if plugin.name in crashed:
                    continue
                try:
                    impl.function(registrar=Registrar(catalog, group, plugin))
                except PluginError:
                    raise
                except Exception as exc:  # a hook that crashes is that plugin's failure alone
                    crashed.add(plugin.name)
                    catalog.failures.append(PluginFailure(plugin.name, plugin.distribution, f"{hook_name} raised {exc!r}"))
                    for table in catalog.components.values():
                        for name in [n for n, c in table.items() if c.plugin == plugin.name]:
                            del table[name]
                    warnings.warn(f"kvweave plugin '{plugin.name}' ({plugin.distribution}) was skipped: {exc!r}", stacklevel=2)
        catalog.plugins = sorted((p for p in self._info.values() if p.name not in crashed), key=lambda p: p.name)
        return catalog


_host: PluginHost | None = None
_catalog: Catalog | None = None


def plugin_host() -> PluginHost:
    """The process-wide plugin host, with every installed entry point loaded."""
    global _host
    if _host is None:
        _host = PluginHost()
        _host.load_entry_points()
    return _host


def catalog() -> Catalog:
    """The components every installed plugin registered (computed once, see :func:`reset`)."""
    global _catalog
    if _catalog is None:
        _catalog = plugin_host().collect()
    return _catalog


def register_plugin(plugin: Any, name: str, distribution: str = "runtime") -> None:
    """Register a plugin object at run time (e.g. in a test or a notebook) and refresh the catalog."""
    global _catalog
    plugin_host().register(plugin, name, distribution)
    _catalog = None


def unregister_plugin(name: str) -> None:
    global _catalog
    plugin_host().unregister(name)
    _catalog = None


def reset() -> None:
    """Forget every loaded plugin; the next call re-reads the entry points."""
    global _host, _catalog
    _host = None
    _catalog = None


def build_component(info: ComponentInfo, params: dict[str, Any], where: str) -> Component:
    """Instantiate ``info.factory`` with ``params``; unknown or invalid parameters name ``where``."""
    accepted = {field.alias: field for field in attrs.fields(info.factory) if field.init}
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        listing = ", ".join(
            f"{name} ({'required' if f.default is attrs.NOTHING else 'default ' + repr(_default(f))})"
            for name, f in accepted.items()
        )
        raise ComponentError(
            f"{where}: unknown parameter(s) {', '.join(map(repr, unknown))} for {info.group} component "
            f"'{info.name}'; accepted: {listing or '(none)'}"
        )
    try:
        return info.factory(**params)
    except (TypeError, ValueError) as exc:
        raise ComponentError(f"{where}: invalid parameters for {info.group} component '{info.name}': {exc}") from exc


def _default(field: attrs.Attribute) -> Any:
    default = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default  # type: ignore[arg-type]
