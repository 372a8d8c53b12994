"""registry.toml: inheritance semantics and the errors bad registries get."""

from __future__ import annotations

import textwrap
from pathlib import Path

import attrs

import pytest

from kvweave.core.errors import RegistryError
from kvweave.core.registry import load_pipeline, load_registry


def write(tmp_path, text: str):
    path = tmp_path / "mine.toml"
    path.write_text(textwrap.dedent(text))
    return path


def test_every_builtin_pipeline_resolves():
    registry = load_registry()
    assert {"full", "int8", "int4"} <= set(registry.names())
    for pipeline in registry.resolve_all():
        shared = {"basis", "quantizer", "router", "residual_quantizer", "probe", "kernel", "evictor"}
        assert shared <= set(pipeline.slots)
        assert all(slot in shared or slot.split(".")[0] in ("keys", "values") for slot in pipeline.slots)


def test_a_pipeline_without_an_evictor_slot_keeps_every_token(tmp_path):
    path = write(tmp_path, """
        [pipelines.bare]
        [pipelines.bare.basis]
        use = "identity"
        [pipelines.bare.quantizer]
        use = "int4-group"
        [pipelines.bare.router]
        use = "uniform"
        [pipelines.bare.residual_quantizer]
        use = "none"
        [pipelines.bare.probe]
        use = "none"
        [pipelines.bare.kernel]
        use = "reference"
    """)
    pipeline = load_pipeline("bare", path)
    assert pipeline.use("evictor") == "none" and not pipeline.component("evictor").evicts


def test_keys_and_values_may_take_their_own_quantizers(tmp_path):
    path = write(tmp_path, """
        [pipelines.k4v8]
        extends = "int4"
        [pipelines.k4v8.values.quantizer]
        use = "int8-block"
        block = 32

        [pipelines.k4v8-g16]
        extends = "k4v8"
        [pipelines.k4v8-g16.values.quantizer]
        block = 16
    """)
    pipeline = load_pipeline("k4v8", path)
    assert pipeline.slot_for("quantizer", "keys") == "quantizer"
    assert pipeline.slot_for("quantizer", "values") == "values.quantizer"
    assert pipeline.use("values.quantizer") == "int8-block"
    assert pipeline.component_for("quantizer", "keys") is pipeline.component("quantizer")
    assert pipeline.component_for("quantizer", "values").block == 32
    assert pipeline.to_dict()["slots"]["values.quantizer"]["params"]["block"] == 32
    child = load_pipeline("k4v8-g16", path)  # no 'use': only the parameter changes, the kind's slot stays
    assert child.use("values.quantizer") == "int8-block" and child.component_for("quantizer", "values").block == 16


@pytest.mark.parametrize("body, fragments", [
    ('[pipelines.x.keys.router]\nuse = "uniform"', ["'keys.router' is not a slot that may differ", "quantizer, residual_quantizer"]),
    ('[pipelines.x.values.quantizer]\nblock = 8', ["slot 'values.quantizer' overrides parameters but no parent defines", "add 'use'"]),
    ('keys = 3', ["'keys' must be a table of slot tables"]),
    ('[pipelines.x.keys.quantizer]\nuse = "int9"', ["slot 'keys.quantizer'", "unknown quantizers component 'int9'"]),
])
def test_bad_per_kind_slots_are_refused_naming_pipeline_and_slot(tmp_path, body, fragments):
    path = tmp_path / "mine.toml"
    path.write_text('[pipelines.x]\nextends = "int4"\n' + body + "\n")
    with pytest.raises(RegistryError) as caught:
        load_pipeline("x", path)
    message = str(caught.value)
    assert "pipeline 'x'" in message
    for fragment in fragments:
        assert fragment in message, message


def test_child_slot_without_use_overrides_only_its_parameters(tmp_path):
    path = write(tmp_path, """
        [pipelines.int4-g16]
        extends = "int4"
        [pipelines.int4-g16.quantizer]
        group = 16
    """)
    pipeline = load_pipeline("int4-g16", path)
    quantizer = pipeline.component("quantizer")
    assert pipeline.slots["quantizer"].use == "int4-group"
    assert (quantizer.group, quantizer.scale_dtype) == (16, "float16")
    assert pipeline.chain == ("int4-g16", "int4", "full")
    assert pipeline.settings.recent_window == 128  # inherited from int4


def test_child_slot_with_use_replaces_the_parent_slot_wholly(tmp_path):
    path = write(tmp_path, """
        [pipelines.swap]
        extends = "int4"
        [pipelines.swap.quantizer]
        use = "int8-block"
    """)
    quantizer = load_pipeline("swap", path).component("quantizer")
    assert type(quantizer).__name__ == "Int8BlockQuantizer" and quantizer.block == 64  # 'group' not carried over


def test_unknown_component_lists_what_is_available(tmp_path):
    path = write(tmp_path, """
        [pipelines.bad]
        extends = "int4"
        [pipelines.bad.router]
        use = "no-such-router"
    """)
    with pytest.raises(RegistryError) as info:
        load_pipeline("bad", path)
    message = str(info.value)
    assert "pipeline 'bad'" in message and "slot 'router'" in message and "no-such-router" in message
    assert "uniform" in message and str(path) in message


@pytest.mark.parametrize(
    "body, fragments",
    [
        ('[pipelines.bad.quantizer]\ngroup = "x"', ["slot 'quantizer'", "group"]),
        ("[pipelines.bad.quantizer]\ngroup = 3", ["slot 'quantizer'", "even"]),
        ("[pipelines.bad.quantizer]\ngruop = 16", ["gruop", "accepted", "group"]),
        ("[pipelines.bad.router]\nrank = -1", ["slot 'router'", "rank"]),
        ("[pipelines.bad.cache]\nuse = 'x'", ["unknown key 'cache'", "slot tables"]),
        ("recent_window = -5", ["recent_window", ">= 0"]),
        ("compress = 'yes'", ["compress"]),
    ],
)
def test_bad_parameters_name_pipeline_slot_and_key(tmp_path, body, fragments):
    path = write(tmp_path, '[pipelines.bad]\nextends = "int4"\n' + body + "\n")
    with pytest.raises(RegistryError) as info:
        load_pipeline("bad", path)
    message = str(info.value)
    assert "pipeline 'bad'" in message
    for fragment in fragments:
        assert fragment in message


def test_cycles_in_extends_are_reported_with_the_chain(tmp_path):
    path = write(tmp_path, """
        [pipelines.a]
        extends = "b"
        [pipelines.b]
        extends = "c"
        [pipelines.c]
        extends = "a"
    """)
    with pytest.raises(RegistryError, match="cycle: a -> b -> c -> a"):
        load_pipeline("a", path)


def test_malformed_toml_names_the_file(tmp_path):
    path = write(tmp_path, "[pipelines.x\nuse = 1\n")
    with pytest.raises(RegistryError, match="not valid TOML") as info:
        load_registry(path)
    assert str(path) in str(info.value)


def test_extending_an_unknown_pipeline(tmp_path):
    path = write(tmp_path, '[pipelines.x]\nextends = "nope"\n')
    with pytest.raises(RegistryError, match="extends unknown pipeline 'nope'.*int4"):
        load_pipeline("x", path)


def test_a_user_file_cannot_redefine_a_builtin_pipeline(tmp_path):
    path = write(tmp_path, '[pipelines.int4]\nextends = "full"\n')
    with pytest.raises(RegistryError, match="already defined"):
        load_registry(path)


def test_a_root_pipeline_must_fill_every_slot(tmp_path):
    path = write(tmp_path, """
        [pipelines.root]
        [pipelines.root.basis]
        use = "identity"
    """)
    with pytest.raises(RegistryError, match="slot 'quantizer' has no component.*int8-block"):
        load_pipeline("root", path)


def test_unknown_pipeline_name_lists_the_defined_ones():
    with pytest.raises(RegistryError, match="unknown pipeline 'nope'.*full"):
        load_pipeline("nope")


def test_a_missing_registry_file():
    with pytest.raises(RegistryError, match="does not exist"):
        load_registry("/no/such/registry.toml")


def test_top_level_tables_other_than_pipelines_are_refused(tmp_path):
    path = write(tmp_path, "[pipeline.x]\nextends='full'\n")
    with pytest.raises(RegistryError, match="unknown top-level"):
        load_registry(path)


@pytest.mark.parametrize(
    "shipped_name, measured_name",
    [("kvzip-qa35v3", "kz-qa35v3-f77-cp"), ("kvzip-qa3-vl25-smollm2", "kz-qa3-vl25-f48-cp")],
)
def test_the_shipped_kvzip_pipelines_are_the_ones_measured(shipped_name, measured_name):
    """registry.toml's KVzip pipelines resolve to exactly the components and settings of the pipelines the
    frontier measured (benchmarks/lean_sweep.toml, docs/frontier.md): a change to either leaves the shipped
    pipeline's figures unmeasured."""
    registry = load_registry(Path(__file__).resolve().parents[1] / "benchmarks" / "lean_sweep.toml")
    shipped, measured = registry.resolve(shipped_name), registry.resolve(measured_name)
    assert shipped.source.endswith("registry.toml") and measured.source.endswith("lean_sweep.toml")
    assert attrs.asdict(shipped)["slots"] == attrs.asdict(measured)["slots"]
    assert shipped.settings == measured.settings
    assert shipped.slots["evictor"].use == "kvzip"
