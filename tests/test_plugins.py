"""Plugin discovery: built-ins come through entry points, duplicates are refused naming both plugins,
and a broken plugin is reported while the others still load."""

from __future__ import annotations

import attrs
import pytest
import torch

from kvweave.core import hookimpl, plugins
from kvweave.core.errors import ComponentError, PluginError
from kvweave.core.interfaces import Router


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


def test_a_duplicate_name_is_refused_naming_both_plugins():
    plugins.register_plugin(DuplicateUniformPlugin(), "dup-plugin", distribution="dup-dist")
    with pytest.raises(PluginError) as info:
        plugins.catalog()
    message = str(info.value)
    assert "'uniform'" in message and "uniform-router" in message and "dup-plugin" in message and "dup-dist" in message


def test_registering_something_that_is_not_a_component_is_refused():
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
    with pytest.raises(PluginError, match="not an attrs class"):
        plugins.catalog()


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


def test_plugins_can_be_disabled_by_name(monkeypatch):
    monkeypatch.setenv(plugins.DISABLE_ENV, "int8-block, uniform-router")
    catalog = plugins.catalog()
    assert "int8-block" not in catalog.components["quantizers"]
    assert "uniform" not in catalog.components["routers"]
    assert "int4-group" in catalog.components["quantizers"]


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
