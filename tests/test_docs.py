"""The docs keep up with the code: every hook and every built-in component is documented."""

from __future__ import annotations

import inspect
from pathlib import Path

from kvweave.core import hookspecs, plugins

DOCS = Path(__file__).parents[1] / "docs"


def test_every_hook_is_documented_with_its_signature():
    text = (DOCS / "plugins.md").read_text()
    hooks = [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction) if name.startswith("kvweave_")]
    assert len(hooks) == len(plugins.GROUP_INTERFACES) == 6
    for name in hooks:
        parameters = ", ".join(inspect.signature(getattr(hookspecs, name)).parameters)
        assert f"`{name}({parameters})`" in text, name


def test_every_builtin_component_is_named_in_the_plugin_docs():
    text = (DOCS / "plugins.md").read_text()
    for info in plugins.catalog().iter_components():
        if info.distribution == "kvweave":
            assert f"`{info.name}`" in text, (info.group, info.name)


def test_readme_commands_match_ci():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    ci = (Path(__file__).parents[1] / ".ci" / "run").read_text()
    test_command = [line for line in ci.splitlines() if line.startswith("pip install torch==2.13.0")]
    assert len(test_command) == 1 and test_command[0] in readme
