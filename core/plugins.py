"""Plugin discovery: entry points of the ``kvweave`` group, registered into one pluggy manager.

Built-in components are plugins like any other: kvweave's own distribution lists its plugin modules
under ``[project.entry-points.kvweave]``. A plugin that fails to import, whose hooks are invalid or raise,
or that registers something that is not a component is reported (naming its entry point and
distribution) and skipped; the others still load. Two plugins registering the same component name do
not stop anything either: the name becomes *ambiguous* (listed by ``kvweave plugins``), and only
resolving a pipeline that uses it fails, naming both plugins. Set ``KVWEAVE_DISABLE_PLUGINS=name1,name2``
to skip plugins by entry-point name (unknown names are warned about, listing the installed ones).

This module does not import torch itself: the component interfaces (``kvweave.core.groups``) are imported
when the catalog is first collected, so that listing commands cost only what the plugin modules import.
"""

from __future__ import annotations

import importlib.metadata
import os
import warnings
from typing import TYPE_CHECKING, Any, Iterator

import attrs
import pluggy

from kvweave.core import hookspecs
from kvweave.core.errors import ComponentError, PluginError

if TYPE_CHECKING:
    from kvweave.core.interfaces import Component

ENTRY_POINT_GROUP = "kvweave"
DISABLE_ENV = "KVWEAVE_DISABLE_PLUGINS"
_HOOK_PREFIX = "kvweave_register_"
#: component group -> its registration hook, in the order the hook specs define them
HOOK_FOR_GROUP: dict[str, str] = {
    name[len(_HOOK_PREFIX):]: name for name in vars(hookspecs) if name.startswith(_HOOK_PREFIX)
}


def __getattr__(name: str) -> Any:
    # ``plugins.GROUP_INTERFACES`` (the interface class of each group) stays available, imported when first
    # asked for, as the catalog imports the interfaces when it is first collected.
    if name == "GROUP_INTERFACES":
        from kvweave.core.groups import GROUP_INTERFACES

        return GROUP_INTERFACES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AmbiguousComponentError(ComponentError, PluginError):
    """A pipeline asked for a component name that two or more installed plugins registered."""


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

    def owner(self) -> str:
        return f"plugin '{self.plugin}' (distribution {self.distribution})"


@attrs.frozen
class Conflict:
    """A component name of ``group`` registered more than once: by every plugin in ``claims``, in order."""

    group: str
    name: str
    claims: tuple[ComponentInfo, ...]

    def describe(self) -> str:
        owners = [claim.owner() for claim in self.claims]
        listed = " and ".join(owners) if len(owners) == 2 else ", ".join(owners[:-1]) + ", and " + owners[-1]
        disable = ",".join(dict.fromkeys(claim.plugin for claim in self.claims[1:]))
        return (
            f"{self.group} component '{self.name}' is registered by {listed}, so a pipeline that uses it cannot "
            f"tell which is meant. Rename one of them, or disable a plugin with {DISABLE_ENV}={disable}"
        )


class Registrar:
    """Handed to a registration hook; ``add(name, factory)`` registers one component of ``group``."""

    def __init__(self, catalog: Catalog, group: str, plugin: PluginInfo) -> None:
        self._catalog = catalog
        self.group = group
        self.plugin = plugin

    def add(self, name: str, factory: type) -> None:
        """Register ``factory`` (an attrs class implementing the group's interface) under ``name``.

        A name another plugin (or this one) registered already is kept as a conflict, not refused: the
        name is then ambiguous, and only a pipeline that uses it fails (:meth:`Catalog.get`)."""
        from kvweave.core.groups import GROUP_INTERFACES

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
        self._catalog.claim(ComponentInfo(self.group, name, factory, self.plugin.name, self.plugin.distribution))


@attrs.define
class Catalog:
    """Everything the installed plugins provide.

    ``components`` maps each group to its names; a name in ``conflicts`` (registered by several plugins)
    maps to its first registration there, and :meth:`get` refuses it naming every plugin that claims it.
    ``disabled`` are the plugins :data:`DISABLE_ENV` switched off (not imported, so no hooks)."""

    plugins: list[PluginInfo] = attrs.field(factory=list)
    failures: list[PluginFailure] = attrs.field(factory=list)
    components: dict[str, dict[str, ComponentInfo]] = attrs.field(
        factory=lambda: {group: {} for group in HOOK_FOR_GROUP}
    )
    conflicts: list[Conflict] = attrs.field(factory=list)
    disabled: list[PluginInfo] = attrs.field(factory=list)
    _claims: dict[tuple[str, str], list[ComponentInfo]] = attrs.field(factory=dict, repr=False)

    def claim(self, info: ComponentInfo) -> None:
        """Record a registration (the first of a name is what ``components`` lists)."""
        self._claims.setdefault((info.group, info.name), []).append(info)
        self.components[info.group].setdefault(info.name, info)
        self._update_conflicts()

    def drop_plugin(self, plugin: str) -> None:
        """Forget every registration of ``plugin`` (a plugin whose hook failed is dropped whole)."""
        for (group, name), claims in list(self._claims.items()):
            kept = [claim for claim in claims if claim.plugin != plugin]
            if kept:
                self._claims[(group, name)] = kept
                self.components[group][name] = kept[0]
            else:
                del self._claims[(group, name)]
                self.components[group].pop(name, None)
        self._update_conflicts()

    def _update_conflicts(self) -> None:
        self.conflicts = [Conflict(group, name, tuple(claims)) for (group, name), claims in self._claims.items() if len(claims) > 1]

    def conflict(self, group: str, name: str) -> Conflict | None:
        """The conflict over ``name`` of ``group``, if several plugins registered it."""
        return next((c for c in self.conflicts if c.group == group and c.name == name), None)

    def get(self, group: str, name: str) -> ComponentInfo:
        """The component ``name`` of ``group``; a :class:`ComponentError` listing what is available when it
        is unknown, an :class:`AmbiguousComponentError` naming every plugin that registered it when several did."""
        if group not in self.components:
            raise ComponentError(f"unknown component group '{group}'; groups are: {', '.join(self.components)}")
        conflict = self.conflict(group, name)
        if conflict is not None:
            raise AmbiguousComponentError(conflict.describe())
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


def _disabled() -> list[str]:
    return list(dict.fromkeys(name.strip() for name in os.environ.get(DISABLE_ENV, "").split(",") if name.strip()))


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
        self.disabled: list[PluginInfo] = []

    def load_entry_points(self) -> None:
        disabled = _disabled()
        entry_points = list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))
        unknown = [name for name in disabled if name not in {ep.name for ep in entry_points}]
        if unknown:
            known = ", ".join(sorted({ep.name for ep in entry_points})) or "(none)"
            warnings.warn(
                f"{DISABLE_ENV} names {len(unknown)} unknown plugin(s): {', '.join(unknown)}; nothing was disabled "
                f"for them. Installed plugins (entry-point names): {known}",
                stacklevel=2,
            )
        seen: dict[str, tuple[str, str]] = {}
        for entry_point in entry_points:
            dist_name, version = _distribution_of(entry_point)
            if entry_point.name in seen:
                if seen[entry_point.name] != (dist_name, entry_point.value):  # not the same distribution found twice
                    first_dist, first_value = seen[entry_point.name]
                    self._fail(entry_point.name, dist_name, f"entry point '{entry_point.name} = {entry_point.value}' "
                               f"has the name of distribution {first_dist}'s entry point (= {first_value}), which was "
                               "loaded instead; plugin names must be unique")
                continue
            seen[entry_point.name] = (dist_name, entry_point.value)
            if entry_point.name in disabled:
                self.disabled.append(PluginInfo(entry_point.name, dist_name, version, ()))
                continue
            if entry_point.name in self._info:
                continue
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

        A plugin whose hook raises, or registers something that is not a component (:class:`PluginError`
        from :meth:`Registrar.add`), is dropped whole: its components from earlier hooks are removed and its
        later hooks are not called; it is listed in ``failures``. A name registered twice is kept as a
        conflict (``conflicts``) and warned about; nothing fails until a pipeline uses that name."""
        catalog = Catalog(failures=list(self.failures), disabled=list(self.disabled))
        crashed: set[str] = set()
        for group, hook_name in HOOK_FOR_GROUP.items():
            for impl in getattr(self.manager.hook, hook_name).get_hookimpls():
                plugin = self._info[impl.plugin_name]
                if plugin.name in crashed:
                    continue
                try:
                    impl.function(registrar=Registrar(catalog, group, plugin))
                except Exception as exc:  # a hook that crashes is that plugin's failure alone
                    crashed.add(plugin.name)
                    reason = str(exc) if isinstance(exc, PluginError) else f"{hook_name} raised {exc!r}"
                    catalog.failures.append(PluginFailure(plugin.name, plugin.distribution, reason))
                    catalog.drop_plugin(plugin.name)
                    warnings.warn(f"kvweave plugin '{plugin.name}' (distribution {plugin.distribution}) was skipped: {reason}",
                                  stacklevel=2)
        for conflict in catalog.conflicts:
            warnings.warn(f"{conflict.describe()} (see 'kvweave plugins')", stacklevel=2)
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
