"""A setting read from the environment when its module is imported, checked in child Pythons."""

from __future__ import annotations

import os
import subprocess
import sys


def check_env_setting(variable: str, script: str, cases: dict[str, str], refused: str) -> None:
    """``script`` run with ``variable`` set to each value of ``cases`` prints that value's expected line; set to
    ``refused`` it fails with a message that names the variable and the value."""
    for value, expected in cases.items():
        run = subprocess.run([sys.executable, "-c", script], env={**os.environ, variable: value}, capture_output=True,
                             text=True)
        assert run.stdout.strip() == expected, (value, run.stderr[-2000:])
    run = subprocess.run([sys.executable, "-c", script], env={**os.environ, variable: refused}, capture_output=True,
                         text=True)
    assert run.returncode != 0 and f"{variable}={refused!r}" in run.stderr, run.stderr[-2000:]
