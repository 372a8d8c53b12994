"""The command line: listings, JSON output, and one-paragraph errors with exit code 2."""

from __future__ import annotations

import json

import pytest

from kvweave.tools.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_components_json_lists_parameters_with_types_and_defaults(capsys):
    code, out, _ = run(capsys, "components", "--group", "quantizers", "--json")
    assert code == 0
    items = {item["name"]: item for item in json.loads(out)}
    assert set(items) >= {"none", "int8-block", "int4-group"}
    group = next(p for p in items["int4-group"]["parameters"] if p["name"] == "group")
    assert group["default"] == 32 and group["type"] == "int"
    assert all(item["group"] == "quantizers" for item in items.values())


def test_plugins_lists_each_builtin_with_its_hooks(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    plugins = {p["name"]: p for p in json.loads(out)["plugins"]}
    assert code == 0 and plugins["uniform-router"]["hooks"] == ["kvweave_register_routers"]


def test_pipelines_and_resolve(capsys):
    code, out, _ = run(capsys, "pipelines", "--json")
    names = [p["name"] for p in json.loads(out)]
    assert code == 0 and names[:3] == ["full", "int8", "int4"]
    code, out, _ = run(capsys, "resolve", "int4", "--json")
    data = json.loads(out)
    assert code == 0 and data["extends_chain"] == ["int4", "full"]
    assert data["slots"]["quantizer"]["params"] == {"group": 32, "scale_dtype": "float16"}


def test_resolve_human_output_names_every_slot(capsys):
    code, out, _ = run(capsys, "resolve", "int4-outliers")
    assert code == 0
    for slot in ("basis", "quantizer", "router", "residual_quantizer", "probe", "kernel"):
        assert slot in out


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["resolve", "nope"], "unknown pipeline 'nope'"),
        (["components", "--group", "widgets"], "unknown group 'widgets'"),
        (["pipelines", "--registry", "/no/such.toml"], "does not exist"),
        (["generate", "--pipeline", "nope", "--prompt", "hi"], "unknown pipeline 'nope'"),
        (["generate", "--pipeline", "int4", "--model", "./no/such/model", "--prompt", "hi"], "./no/such/model"),
        (["generate", "--pipeline", "int4", "--prompt-file", "/no/prompt.txt"], "/no/prompt.txt"),
    ],
)
def test_errors_exit_2_with_one_paragraph(capsys, argv, fragment):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("kvweave: error:") and fragment in err
    assert err.strip().count("\n") == 0
