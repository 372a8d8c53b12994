"""Plugin discovery: built-ins come through entry points; a duplicate name is a conflict that fails only
the pipelines using it (naming both plugins) while the listing commands keep working; a broken plugin is
reported while the others still load; KVWEAVE_DISABLE_PLUGINS warns about names it does not know."""

from __future__ import annotations

import json
import warnings

import attrs
import pytest
import torch

from kvweave.core import hookimpl, plugins
from kvweave.core.errors import ComponentError, PluginError, RegistryError
from kvweave.core.interfaces import Router
from kvweave.core.registry import load_registry
from kvweave.tools.cli import main


@attrs.frozen
class ConstantRouter(Router):
    rank: int = 2

    def levels(self):
        return (self.rank,)

    def assign(self, block):
        return torch.full(block.vectors.shape[:-1], self.rank)


class ExtraRouterPlugin:
    @hookimpl
    def kvweave_register_routers(self, registrar):
        registrar.add("constant-test", ConstantRouter)


class DuplicateUniformPlugin:
    @hookimpl
    def kvweave_register_routers(self, registrar):
        registrar.add("uniform", ConstantRouter)


@pytest.fixture(autouse=True)
def fresh_plugins():
    plugins.reset()
    yield
    plugins.reset()


def test_builtins_are_registered_through_the_kvweave_entry_points():
    catalog = plugins.catalog()
    names = {p.name: p for p in catalog.plugins}
    assert names["int4-group"].distribution == "kvweave"
    assert names["int4-group"].hooks == ("kvweave_register_quantizers",)
    assert catalog.get("quantizers", "int4-group").plugin == "int4-group"
    assert not catalog.failures


def test_a_runtime_plugin_adds_a_component_and_can_be_removed():
    plugins.register_plugin(ExtraRouterPlugin(), "extra-router")
    try:
        assert plugins.catalog().get("routers", "constant-test").plugin == "extra-router"
    finally:
        plugins.unregister_plugin("extra-router")
    with pytest.raises(ComponentError, match="constant-test"):
        plugins.catalog().get("routers", "constant-test")


def _register_duplicate():
    with pytest.warns(UserWarning, match="routers component 'uniform' is registered by plugin 'uniform-router'"):
        plugins.register_plugin(DuplicateUniformPlugin(), "dup-plugin", distribution="dup-dist")
        return plugins.catalog()


def _names_both(message: str) -> bool:
    return all(part in message for part in ("'uniform'", "uniform-router", "kvweave", "dup-plugin", "dup-dist"))


def test_a_duplicate_name_is_a_conflict_that_fails_only_what_uses_it():
    catalog = _register_duplicate()
    (conflict,) = catalog.conflicts
    assert (conflict.group, conflict.name) == ("routers", "uniform")
    assert [c.plugin for c in conflict.claims] == ["uniform-router", "dup-plugin"]
    assert catalog.get("quantizers", "int4-group").plugin == "int4-group"  # the rest is usable
    with pytest.raises(PluginError) as info:  # an AmbiguousComponentError is both a PluginError and a ComponentError
        catalog.get("routers", "uniform")
    assert isinstance(info.value, ComponentError) and _names_both(str(info.value))
    registry = load_registry()
    with pytest.raises(RegistryError) as info:
        registry.resolve("int4")  # inherits router 'uniform' from 'full'
    assert "pipeline 'int4'" in str(info.value) and "slot 'router'" in str(info.value) and _names_both(str(info.value))
    assert registry.resolve("depthweave-kv").use("router") != "uniform"  # a pipeline without it still resolves


def test_a_duplicate_name_keeps_the_diagnostic_commands_working(capsys):
    _register_duplicate()
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "CONFLICT routers/uniform" in out and _names_both(out)
    assert main(["plugins", "--json"]) == 0
    (conflict,) = json.loads(capsys.readouterr().out)["conflicts"]
    assert conflict["plugins"] == [{"plugin": "uniform-router", "distribution": "kvweave"},
                                   {"plugin": "dup-plugin", "distribution": "dup-dist"}]
    assert main(["components", "--group", "routers", "--json"]) == 0
    claims = [item for item in json.loads(capsys.readouterr().out) if item["name"] == "uniform"]
    assert [c["plugin"] for c in claims] == ["uniform-router", "dup-plugin"] and all("conflict" in c for c in claims)
    assert main(["components"]) == 0 and "AMBIGUOUS" in capsys.readouterr().out
    assert main(["pipelines"]) == 0
    assert main(["resolve", "depthweave-kv"]) == 0
    capsys.readouterr()
    assert main(["resolve", "int4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvweave: error:") and err.strip().count("\n") == 0 and _names_both(err)


def test_registering_something_that_is_not_a_component_drops_that_plugin_only():
    class NotAttrs(Router):
        def levels(self):
            return (0,)

        def assign(self, block):
            return None

    class Bad:
        @hookimpl
        def kvweave_register_routers(self, registrar):
            registrar.add("bad", NotAttrs)

    plugins.register_plugin(Bad(), "bad-plugin")
    with pytest.warns(UserWarning, match="bad-plugin"):
        catalog = plugins.catalog()
    failure = next(f for f in catalog.failures if f.name == "bad-plugin")
    assert "not an attrs class" in failure.error
    assert "bad" not in catalog.components["routers"] and "bad-plugin" not in {p.name for p in catalog.plugins}
    assert catalog.get("routers", "uniform")  # the others still load
    with pytest.raises(ComponentError, match="failed to load.*bad-plugin"):
        catalog.get("routers", "bad")


def test_hooks_and_groups_agree():
    assert list(plugins.HOOK_FOR_GROUP) == list(plugins.GROUP_INTERFACES)


def _fake_distribution(root, name: str, module: str, body: str | None):
    """A minimal installed distribution on ``root`` with one kvweave entry point."""
    info = root / f"{name.replace('-', '_')}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kvweave]\n{name} = {module}\n")
    if body is not None:
        (root / f"{module}.py").write_text(body)


def test_a_plugin_that_fails_to_import_is_reported_and_the_others_load(tmp_path, monkeypatch):
    _fake_distribution(tmp_path, "broken-kvweave-plugin", "broken_kvweave_plugin", "raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="broken-kvweave-plugin"):
        catalog = plugins.catalog()
    failure = next(f for f in catalog.failures if f.name == "broken-kvweave-plugin")
    assert failure.distribution == "broken-kvweave-plugin" and "boom" in failure.error
    assert catalog.get("quantizers", "int8-block")  # the others still load
    with pytest.raises(ComponentError, match="failed to load.*broken-kvweave-plugin"):
        catalog.get("routers", "whatever")


def test_a_plugin_with_an_unknown_hook_is_reported(tmp_path, monkeypatch):
    body = "from kvweave.core import hookimpl\n@hookimpl\ndef kvweave_register_widgets(registrar):\n    pass\n"
    _fake_distribution(tmp_path, "typo-plugin", "typo_kvweave_plugin", body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.warns(UserWarning, match="typo-plugin"):
        catalog = plugins.catalog()
    failure = next(f for f in catalog.failures if f.name == "typo-plugin")
    assert "kvweave_register_widgets" in failure.error
    assert "typo-plugin" not in {p.name for p in catalog.plugins}


def test_plugins_can_be_disabled_by_name(monkeypatch, capsys):
    monkeypatch.setenv(plugins.DISABLE_ENV, "int8-block, uniform-router")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # known names: no warning
        catalog = plugins.catalog()
    assert "int8-block" not in catalog.components["quantizers"]
    assert "uniform" not in catalog.components["routers"]
    assert "int4-group" in catalog.components["quantizers"]
    assert {p.name for p in catalog.disabled} == {"int8-block", "uniform-router"}
    assert main(["plugins"]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("int8-block "))
    assert "DISABLED" in line and "kvweave" in line
    assert main(["plugins", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {p["name"] for p in data["disabled"]} == {"int8-block", "uniform-router"}
    assert "int8-block" not in {p["name"] for p in data["plugins"]}


def test_unknown_names_to_disable_are_warned_about_listing_the_known_ones(monkeypatch, capsys):
    monkeypatch.setenv(plugins.DISABLE_ENV, "int8-block,int8_block,no-such-plugin")
    with pytest.warns(UserWarning) as record:
        catalog = plugins.catalog()
    (message,) = [str(w.message) for w in record if plugins.DISABLE_ENV in str(w.message)]
    assert "int8_block, no-such-plugin" in message and "int4-group" in message and "uniform-router" in message
    assert {p.name for p in catalog.disabled} == {"int8-block"}
    plugins.reset()
    assert main(["plugins"]) == 0  # on the command line: one line, kvweave's own prefix
    err = capsys.readouterr().err
    assert err.startswith(f"kvweave: warning: {plugins.DISABLE_ENV} names 2 unknown plugin(s): int8_block, no-such-plugin")
    assert err.strip().count("\n") == 0


def test_a_plugin_whose_hook_crashes_is_dropped_whole():
    @attrs.frozen
    class Passthrough(plugins.GROUP_INTERFACES["quantizers"]):
        def quantize(self, x):
            return {"values": x}

        def dequantize(self, packed, dtype):
            return packed["values"].to(dtype)

        def bytes_per_vector(self, width, dtype):
            return width * 4

    class HalfBroken:
        @hookimpl
        def kvweave_register_bases(self, registrar):
            raise RuntimeError("bases hook exploded")

        @hookimpl
        def kvweave_register_quantizers(self, registrar):
            registrar.add("q-from-broken", Passthrough)

    plugins.register_plugin(HalfBroken(), "half-broken")
    with pytest.warns(UserWarning, match="half-broken"):
        catalog = plugins.catalog()
    assert "q-from-broken" not in catalog.components["quantizers"]
    assert "half-broken" not in {p.name for p in catalog.plugins}
    assert any(f.name == "half-broken" and "exploded" in f.error for f in catalog.failures)
