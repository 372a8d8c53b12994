"""The pipeline's ``products`` setting: a block's float32 products on TF32 tensor cores while it is stored on a CUDA GPU,
the process's own matmul precision restored after (torch's new and legacy ways of setting it); refused by name when
misspelt; CPU storage unchanged by it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvweave.core.errors import RegistryError
from kvweave.core.precision import float32_products
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs

from conftest import ToyTokenizer, tiny_llama, write_registry

PIPELINES = """
[pipelines.t-dw-tf32]
extends = "depthweave-kv"
products = "tf32"

[pipelines.t-dw-typo]
extends = "depthweave-kv"
products = "fp16"
"""


def test_tf32_products_hold_inside_the_block_and_the_setting_is_restored_after_it():
    before = _matmul_setting()
    with float32_products("tf32"):
        assert _matmul_setting() == "tf32"
    assert _matmul_setting() == before
    with pytest.raises(KeyError):
        with float32_products("tf32"):
            raise KeyError("inside")
    assert _matmul_setting() == before
    with float32_products("float32"):
        assert _matmul_setting() == before
    with pytest.raises(ValueError, match="products must be one of float32, tf32, got 'fp16'"):
        with float32_products("fp16"):
            pass


@pytest.mark.parametrize("setup, read, expected", [
    ("torch.backends.cuda.matmul.allow_tf32 = False", "torch.backends.cuda.matmul.allow_tf32", ["True", "False"]),
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "torch.backends.cuda.matmul.fp32_precision",
     ["tf32", "ieee"]),
])
def test_a_process_keeps_the_way_it_set_matmul_precision(setup, read, expected):
    """torch refuses to read the legacy flag after the new string was set: a process that set either finds its own
    setting inside the block and restored after, and can still read it the way it set it."""
    if "fp32_precision" in setup and not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip("torch before 2.9")
    script = (
        "import torch\n"
        "from kvweave.core.precision import float32_products\n"
        f"{setup}\n"
        "with float32_products('tf32'):\n"
        f"    inside = {read}\n"
        f"print(inside, {read})\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ))
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == expected


@pytest.mark.filterwarnings("ignore:.*target_reduction asks")
def test_a_pipeline_stores_its_blocks_under_its_products_setting(tmp_path, monkeypatch):
    """``products = "tf32"`` holds while each block is encoded (and only then); on a CPU the stored bytes are those of
    the float32 pipeline; a misspelt value is refused naming the pipeline, the setting and the choices."""
    registry = load_registry(write_registry(tmp_path, "products", PIPELINES))
    with pytest.raises((RegistryError, ValueError), match=r"'products' must be one of 'float32', 'tf32'; got 'fp16'"):
        registry.resolve("t-dw-typo")
    model = tiny_llama(layers=4, hidden=256)  # head_dim 64: the budget fits
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    stored = {}
    for name in ("depthweave-kv", "t-dw-tf32"):
        cache = build_cache(registry.resolve(name), model, tokenizer=ToyTokenizer())
        seen = []
        real = cache.engine.encoder.encode
        cache.engine.encoder.encode = lambda *a, **k: seen.append(_matmul_setting()) or real(*a, **k)
        before = _matmul_setting()
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
        assert seen and _matmul_setting() == before
        assert set(seen) == ({"tf32"} if name == "t-dw-tf32" else {before})
        stored[name] = [cache.engine.view(layer).keys.coefficients["codes"] for layer in range(4)]
        assert cache.engine.pipeline.settings.products == ("tf32" if name == "t-dw-tf32" else "float32")
    for plain, tf32 in zip(stored["depthweave-kv"], stored["t-dw-tf32"]):
        assert torch.equal(plain, tf32)


def _matmul_setting() -> str:
    """The process's float32 matmul precision, read the way :mod:`kvweave.core.precision` sets it."""
    matmul = torch.backends.cuda.matmul
    try:
        return "tf32" if matmul.allow_tf32 else "ieee"
    except RuntimeError:
        return matmul.fp32_precision


def test_the_sweep_file_asks_depthweave_for_tf32_products():
    """benchmarks/products_sweep.toml, which frontier_eval.sh and decode_e2e.py read to decide the default."""
    from pathlib import Path

    registry = load_registry(Path(__file__).resolve().parents[1] / "benchmarks" / "products_sweep.toml")
    tf32, plain = registry.resolve("depthweave-kv-tf32"), registry.resolve("depthweave-kv")
    assert tf32.settings.products == "tf32" and plain.settings.products == "float32"
    assert {slot: cfg.use for slot, cfg in tf32.slots.items()} == {slot: cfg.use for slot, cfg in plain.slots.items()}

