"""kvweave's entry points ask PyTorch's CUDA allocator for expandable segments (``kvweave.core.allocator``): set where
the user configured nothing, left alone where they did, never after CUDA started; the CLI and the decode benchmarks ask
before anything starts CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from kvweave.core import allocator
from kvweave.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _clear(monkeypatch) -> None:
    for name in allocator.ALLOC_VARIABLES:
        monkeypatch.setenv(name, "")  # restored after the test; empty counts as unset
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def test_set_where_nothing_is_configured_and_left_alone_otherwise(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert allocator.prefer_expandable_segments() is True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    for name in allocator.ALLOC_VARIABLES:  # a user's own configuration, under either name, wins
        _clear(monkeypatch)
        monkeypatch.setenv(name, "max_split_size_mb:512")
        assert allocator.prefer_expandable_segments() is False
        assert os.environ[name] == "max_split_size_mb:512" and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF" if name == "PYTORCH_ALLOC_CONF" else "PYTORCH_ALLOC_CONF")


def test_not_set_under_torchruns_ranks(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert allocator.prefer_expandable_segments() is False and not os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert allocator.prefer_expandable_segments() is True


def test_not_set_once_cuda_has_started(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # the allocator already read its configuration
    assert allocator.prefer_expandable_segments() is False
    assert not os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


def test_the_cli_and_the_decode_benchmark_ask_first(monkeypatch, capsys):
    _clear(monkeypatch)
    assert main(["components"]) == 0
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    env = {k: v for k, v in os.environ.items() if k not in allocator.ALLOC_VARIABLES}
    probe = "import os, sys; sys.argv = ['x']; import decode_e2e; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT / "benchmarks", env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "expandable_segments:True"
