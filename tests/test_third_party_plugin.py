"""A third-party plugin, installed as its own distribution, is found, listed, resolved and used.

The example under examples/kvweave-router-example is pip-installed into a temporary target folder
(not the test environment); every check runs kvweave in a subprocess with that folder on PYTHONPATH,
so importlib.metadata sees the example's entry point exactly as it would after a real install.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "kvweave-router-example"
USER_REGISTRY = EXAMPLE / "my-registry.toml"
DISTRIBUTION = "kvweave-router-example"
ENTRY_POINT = next(iter(tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]["entry-points"]["kvweave"]))
DEFAULTS = {"high_rank": 8, "low_rank": 2, "high_fraction": 0.05, "low_fraction": 0.20}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder holding the installed example (package + dist-info with its entry points)."""
    source = tmp_path_factory.mktemp("plugin-source") / EXAMPLE.name
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    folder = tmp_path_factory.mktemp("plugin-target")
    # built from a copy, so that setuptools' build/ and *.egg-info are not left in the checkout
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--quiet",
               "--target", str(folder), str(source)]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"pip install of the example failed:\n{done.stdout}\n{done.stderr}"
    assert list(folder.glob("kvweave_router_example-0.1.0.dist-info"))
    return folder


def run(target: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python args...`` with ``target`` prepended to PYTHONPATH (and ``env`` added)."""
    environment = {**os.environ, **(env or {})}
    environment["PYTHONPATH"] = os.pathsep.join(p for p in (str(target), os.environ.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=environment, timeout=300)


def cli(target: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return run(target, "-m", "kvweave.tools.cli", *args, env=env)


def routers(target: Path, env: dict[str, str] | None = None) -> dict[str, dict]:
    done = cli(target, "components", "--group", "routers", "--json", env=env)
    assert done.returncode == 0, done.stderr
    return {item["name"]: item for item in json.loads(done.stdout)}


def test_components_lists_the_router_with_its_parameters(target: Path) -> None:
    found = routers(target)
    assert "uniform" in found  # the built-ins are still there
    item = found["norm-tiers"]
    assert (item["group"], item["plugin"], item["distribution"]) == ("routers", ENTRY_POINT, DISTRIBUTION)
    params = {p["name"]: p for p in item["parameters"]}
    assert {name: p["default"] for name, p in params.items()} == DEFAULTS
    assert not any(p["required"] for p in params.values())
    assert all(p["doc"] for p in params.values())


def test_plugins_lists_the_distribution_and_its_hook(target: Path) -> None:
    done = cli(target, "plugins", "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["failures"] == []
    plugin = {p["name"]: p for p in data["plugins"]}[ENTRY_POINT]
    assert (plugin["distribution"], plugin["version"]) == (DISTRIBUTION, "0.1.0")
    assert plugin["hooks"] == ["kvweave_register_routers"]


def test_user_registry_resolves_a_pipeline_using_the_router(target: Path) -> None:
    done = cli(target, "resolve", "int4-norm-tiers", "--registry", str(USER_REGISTRY), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["extends_chain"] == ["int4-norm-tiers", "int4", "full"]
    router = data["slots"]["router"]
    assert (router["use"], router["plugin"], router["distribution"]) == ("norm-tiers", ENTRY_POINT, DISTRIBUTION)
    assert router["params"] == DEFAULTS
    assert data["slots"]["residual_quantizer"]["use"] == "int4-group"
    assert data["slots"]["residual_quantizer"]["params"]["group"] == 2
    assert data["slots"]["quantizer"]["params"]["group"] == 32  # inherited from int4


ROUTING_SNIPPET = textwrap.dedent("""
    import json, sys
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from kvweave.engine.cache import KVWeaveCache
    from kvweave.engine.generation import cache_kwargs
    from kvweave.core.registry import load_registry

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=1024)
    model = LlamaForCausalLM(config).eval()
    pipeline = load_registry(sys.argv[1]).resolve("int4-norm-tiers")
    cache = KVWeaveCache(pipeline, model.config)
    batch = 2
    ids = torch.randint(0, 128, (batch, 300))
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    window = cache.engine.views()[0]
    # The router alone, on a block whose norms are known: token t of every row has norm t + 1.
    block = torch.arange(1, 21, dtype=torch.float32).view(1, 1, 20, 1) * torch.ones(2, 3, 20, 4) / 2
    order = torch.randperm(20)
    from kvweave.core.interfaces import RouteBlock

    route = RouteBlock(layers=(0,), kind="keys", vectors=block[:, :, order].unsqueeze(0), level_bytes={})
    ranks = pipeline.component("router").assign(route)[0][:, :, order.argsort()]  # back in norm order
    print(json.dumps({
        "breakdown": cache.memory_breakdown(),
        "levels": list(cache.engine.levels),
        "batch": batch,
        "heads": cache.shape.num_kv_heads,
        "block_tokens": pipeline.settings.block_tokens,
        "compressed_tokens": window.packed_tokens,
        "entries": {str(r.rank): r.entries for r in window.keys.residuals},
        "ranks_by_norm": ranks.reshape(-1, 20).tolist(),
    }))
""")


def test_a_pipeline_with_the_router_stores_routed_residuals(target: Path) -> None:
    done = run(target, "-c", ROUTING_SNIPPET, str(USER_REGISTRY))
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout.strip().splitlines()[-1])
    assert data["levels"] == [0, 2, 8]
    assert data["breakdown"]["residuals"] > 0
    assert data["breakdown"]["coefficients"] > 0
    assert data["compressed_tokens"] == 128  # 300 tokens - 128 exact, in whole blocks of 64
    rows = data["compressed_tokens"] * data["heads"] * data["batch"]
    blocks = data["compressed_tokens"] // data["block_tokens"]
    tolerance = blocks * data["heads"] * data["batch"]  # rounding: at most one token per block, row and head
    high, low = data["entries"]["8"], data["entries"]["2"]
    assert abs(high - DEFAULTS["high_fraction"] * rows) <= tolerance, data
    assert abs(low - DEFAULTS["low_fraction"] * rows) <= tolerance, data
    assert 0 < high < low
    # 20 tokens per (b, h), ascending norm: 5% -> the largest at rank 8, 20% -> the next 4 at rank 2
    assert data["ranks_by_norm"] == [[0] * 15 + [2] * 4 + [8]] * 6


def test_bad_parameter_names_pipeline_slot_and_parameter(target: Path, tmp_path: Path) -> None:
    registry = tmp_path / "bad.toml"
    registry.write_text(textwrap.dedent("""
        [pipelines.too-many-tiers]
        extends = "int4"
        [pipelines.too-many-tiers.router]
        use = "norm-tiers"
        high_fraction = 2.0
        [pipelines.too-many-tiers.residual_quantizer]
        use = "int4-group"
        group = 2
    """))
    done = cli(target, "resolve", "too-many-tiers", "--registry", str(registry))
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert done.stdout == ""
    message = done.stderr
    assert message.startswith("kvweave: error:")
    assert "'too-many-tiers'" in message
    assert "slot 'router'" in message
    assert "high_fraction" in message
    assert "Traceback" not in message


def test_disabled_plugin_is_not_listed(target: Path) -> None:
    found = routers(target, env={"KVWEAVE_DISABLE_PLUGINS": ENTRY_POINT})
    assert "uniform" in found
    assert "norm-tiers" not in found
