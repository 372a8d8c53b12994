"""Every pipeline of the regression set gives the tokens and stores the bytes recorded before the
architecture change (tests/regression/figures.json, written by tests/regression/record.py on the real
default model): moving code between layers must not change what a pipeline does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from regression.record import PIPELINES, run

pytestmark = pytest.mark.model

FIGURES = json.loads((Path(__file__).parent / "regression" / "figures.json").read_text())


@pytest.mark.parametrize("pipeline", PIPELINES)
def test_pipeline_gives_the_recorded_tokens_and_stores_the_recorded_bytes(real_model, pipeline):
    model, tokenizer = real_model
    recorded = FIGURES[pipeline]
    now = run(pipeline, model, tokenizer)
    assert now["tokens"] == recorded["tokens"]
    assert now["cached_tokens"] == recorded["cached_tokens"]
    assert now["stored_bytes"] == recorded["stored_bytes"], (now["breakdown"], recorded["breakdown"])
    assert now["breakdown"] == recorded["breakdown"]
