"""Compressed caches on models spread over devices (engine/sharding.py, tools/distributed.py, docs/scale-out.md).

- A rank's cache driven directly with its share of the KV heads stores exactly what one process stores for
  those heads (bytes and values), for head-local pipelines; a rank-budget pipeline meets its budget per rank.
- Pipelines whose components mix heads are refused at build time, naming the pipeline, the slot and why.
- Layer-split placements that cut a basis group over two devices are refused; aligned ones are accepted.
- Two real processes (gloo, transformers' tensor-parallel plan) run ``kvweave generate --tp 2`` and
  ``kvweave eval table --tasks needle,speed --tp 2``: same tokens, same stored bytes (the ranks' sum) as one
  process, and only rank 0 prints.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
import torch

from conftest import ToyTokenizer, tiny_llama
from helpers import load_test_pipeline
from kvweave.core.errors import ComponentError, ModelError
from kvweave.core.registry import load_pipeline
from kvweave.engine import build_cache
from kvweave.engine.cache import KVWeaveCache
from kvweave.engine.synthetic import fill_cache
from kvweave.engine.sharding import HeadShard, align_device_map, check_shardable, gather_counts, layer_devices
from kvweave.plugins.quantizers.int4_group import Int4GroupQuantizer
from kvweave.tools.cli import main

HEAD_LOCAL = ("full", "int8", "int4", "int4-outliers", "kivi-2", "prerope-k4v2", "prerope-k3v2")


def _feed(caches: list[tuple[KVWeaveCache, slice, slice]], layers: int, heads: int, q_heads: int, dim: int,
          chunks: tuple[int, ...], seed: int = 0) -> None:
    """Send the same random K/V (and recent queries, for caches that observe them) through every cache's
    update and flush, each cache getting its slice of the KV heads (and of the query heads)."""
    gen = torch.Generator().manual_seed(seed)
    for n in chunks:
        ids = torch.randint(0, 128, (1, n), generator=gen)
        for layer in range(layers):
            keys = torch.randn(1, heads, n, dim, generator=gen)
            values = torch.randn(1, heads, n, dim, generator=gen)
            queries = torch.randn(1, q_heads, min(n, 16), dim, generator=gen)
            for cache, kv, q in caches:
                engine = cache.engine
                if layer == 0 and engine.observer.tap is not None:  # the token ids a bound model's embedding would see
                    engine.observer.tap.pending = ids
                engine.update(layer, keys[:, kv].contiguous(), values[:, kv].contiguous(), materialize=False)
                if engine.own_attention:
                    if engine.observer.active:
                        engine.observer.record(layer, queries[:, q][..., -engine.observer.keep:, :].contiguous(), dim**-0.5,
                                               keys_seen=engine.seq_length(layer))
                    engine.returned_keys.pop(layer, None)
                    engine.after_attention(layer)


def _rank_caches(pipeline, model, size: int = 2) -> list[KVWeaveCache]:
    caches = [KVWeaveCache(pipeline, model.config, HeadShard(rank, size)) for rank in range(size)]
    for cache in caches:
        cache.bind(model, ToyTokenizer())
    return caches


@pytest.mark.parametrize("name", HEAD_LOCAL)
def test_each_rank_stores_exactly_what_one_process_stores_for_its_heads(name):
    model = tiny_llama(torch.float32, layers=3)
    pipeline = load_pipeline(name)
    whole = build_cache(pipeline, model)
    ranks = _rank_caches(pipeline, model)
    assert whole.shard is None and [c.shape.num_kv_heads for c in ranks] == [1, 1] and ranks[1].model_shape.num_kv_heads == 2
    assert set(ranks[0].sharding.values()) == {"head-local"}
    feeds = [(whole, slice(None), slice(None)), (ranks[0], slice(0, 1), slice(0, 2)), (ranks[1], slice(1, 2), slice(2, 4))]
    _feed(feeds, layers=3, heads=2, q_heads=4, dim=16, chunks=(300, 1, 1, 70))
    assert whole.engine.windows[0].compressed_tokens > 0 or name == "full"  # something was packed
    # every rank holds each residual list's block starts (an int32 a block) for its own heads' entries
    starts = sum(lists.chunks.nbytes for window in whole.engine.windows for kind in window.residuals.values()
                 for lists in kind.values() if lists.chunks is not None)
    assert starts > 0 or name != "int4-outliers"
    assert sum(c.memory_bytes() for c in ranks) == whole.memory_bytes() + (len(ranks) - 1) * starts
    for part, value in whole.memory_breakdown().items():
        shared = (len(ranks) - 1) * starts if part == "residuals" else 0
        assert sum(c.memory_breakdown()[part] for c in ranks) == value + shared, part
    assert sum(c.full_cache_bytes_16bit() for c in ranks) == whole.full_cache_bytes_16bit()
    for layer in range(3):
        for kind in ("keys", "values"):
            full = whole.engine.materialize(layer, kind)
            for rank, cache in enumerate(ranks):
                torch.testing.assert_close(cache.engine.materialize(layer, kind), full[:, rank : rank + 1], rtol=0, atol=0)
    gathered = ranks[0].gathered_memory()  # no process group: this rank's own bytes
    assert gathered.rank_bytes == (ranks[0].memory_bytes(),) and gathered.stored_bytes == ranks[0].memory_bytes()


def test_a_rank_budget_pipeline_meets_its_budget_on_every_rank():
    model = tiny_llama(torch.bfloat16, layers=4, hidden=256)  # head_dim 64, as t-dw is sized for
    pipeline = load_test_pipeline("t-dw")
    ranks = _rank_caches(pipeline, model)
    assert ranks[0].sharding["router"] == "rank-budget" and ranks[0].sharding["probe"] == "rank-budget"
    target = pipeline.component("router").target_reduction()
    for rank, cache in enumerate(ranks):  # each rank's own heads (synthetic K/V with cross-layer structure)
        fill_cache(cache, 1, 2048, chunk=1024, seed=rank)
        assert cache.memory_breakdown()["residuals"] > 0  # the budget left room for residuals, and they were routed
        assert target * 0.98 <= cache.compression_ratio() <= target * 1.1  # each rank holds its own share of the budget


@pytest.mark.parametrize("name, slot, why", [
    ("minicache", "basis", "angle between its two layers averaged over all KV heads"),
    ("kvsharer", "basis", "calibrated on mean vectors taken over all KV heads"),
    ("freqdepthkv", "probe", "entropy averaged over all query heads"),
])
def test_a_pipeline_that_mixes_heads_is_refused_naming_pipeline_slot_and_why(name, slot, why):
    config = tiny_llama(torch.float32, layers=12, hidden=256).config
    with pytest.raises(ComponentError) as info:
        KVWeaveCache(load_pipeline(name), config, HeadShard(1, 2))
    message = str(info.value)
    assert f"pipeline '{name}', slot '{slot}'" in message and why in message and "2 tensor-parallel ranks" in message
    KVWeaveCache(load_pipeline(name), config)  # the same pipeline is fine unsharded


def test_undeclared_components_are_refused_and_declared_ones_accepted():
    pipeline = load_pipeline("int4")

    class Undeclared(Int4GroupQuantizer):  # a third party's component (not one of kvweave's own modules)
        pass

    class Declared(Int4GroupQuantizer):
        head_sharding = "head-local"

    def swapped(component):
        return attrs.evolve(pipeline, slots={**pipeline.slots, "quantizer": attrs.evolve(pipeline.slots["quantizer"], component=component)})

    with pytest.raises(ComponentError, match="slot 'quantizer' \\(quantizers 'int4-group'\\) does not say whether it works"):
        check_shardable(swapped(Undeclared(group=32)), HeadShard(0, 2))
    assert check_shardable(swapped(Declared(group=32)), HeadShard(0, 2))["quantizer"] == "head-local"


def test_trained_per_head_gates_and_uneven_head_splits_are_refused(tmp_path):
    config = tiny_llama(torch.float32, layers=4, hidden=256).config
    gates = [[0.5, 0.5]] * 4
    weights = tmp_path / "router.json"
    weights.write_text(json.dumps({"features": ["mass", "spike", "boundary", "probe", "miss"], "u": [1, 1, 1, 1, 1], "bias": 0,
                                   "gates": {"keys": gates, "values": gates}}))
    from conftest import TEST_PIPELINES

    registry = tmp_path / "mine.toml"  # the test pipelines and one of them with trained gates
    registry.write_text(TEST_PIPELINES.read_text() + f'\n[pipelines.gated]\nextends = "t-dw"\n[pipelines.gated.router]\nweights = "{weights}"\n')
    gated = load_pipeline("gated", registry)
    KVWeaveCache(gated, config)  # unsharded, the gates fit the model
    with pytest.raises(ComponentError, match="residual gates are per KV head of the whole model"):
        KVWeaveCache(gated, config, HeadShard(0, 2))
    with pytest.raises(ModelError, match="2 KV heads cannot be split evenly over 4 tensor-parallel ranks"):
        KVWeaveCache(load_pipeline("int4"), config, HeadShard(0, 4))
    with pytest.raises(ModelError, match="0 <= rank < size"):
        HeadShard(2, 2)
    assert gather_counts([1, 2], HeadShard(0, 2)) == [[1, 2]]  # no process group: this rank's values only


def test_a_whole_model_cache_fed_one_ranks_heads_says_how_to_build_a_sharded_one():
    cache = KVWeaveCache(load_pipeline("int4"), tiny_llama(torch.float32, layers=3).config)  # the config alone: no shard
    with pytest.raises(ModelError, match=r"keys shaped \(1, 1, 4, 16\); the cache was built for 2 KV heads .* build_cache\(pipeline, model\)"):
        cache.engine.update(0, torch.zeros(1, 1, 4, 16), torch.zeros(1, 1, 4, 16))


def test_a_layer_split_that_cuts_a_basis_group_is_refused_and_an_aligned_one_accepted():
    model = tiny_llama(torch.float32, layers=4, hidden=256)
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
             "model.layers.2.self_attn": 0, "model.layers.2.mlp": 0, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}
    model.hf_device_map = split
    assert [str(d) for d in layer_devices(model, 4)] == ["cuda:0", "cuda:0", "cuda:0", "cuda:1"]
    pipeline = load_test_pipeline("t-dw")  # windows of 2 layers: (0, 1), (2, 3)
    with pytest.raises(ModelError) as info:
        build_cache(pipeline, model)
    assert "pipeline 't-dw', slot 'basis' ('sketch-ema'): layers 2..3 are encoded together" in str(info.value)
    assert "layer 2 on cuda:0, layer 3 on cuda:1" in str(info.value)
    build_cache("int4", model)  # one layer per group: any placement works
    groups = pipeline.component("basis").layer_groups(build_cache("int4", model).model_shape)
    whole_layers = {k: v for k, v in split.items() if not k.startswith("model.layers.2.")} | {"model.layers.2": 0}
    model.hf_device_map = align_device_map(whole_layers, groups)  # layer 3 joins layer 2, its group's first
    assert [str(d) for d in layer_devices(model, 4)] == ["cuda:0"] * 4 and model.hf_device_map["lm_head"] == 1
    assert build_cache(pipeline, model, tokenizer=ToyTokenizer()).shard is None
    with pytest.raises(ModelError, match="device map has no entry 'model.layers.2'"):
        align_device_map(split, groups)  # layer 2 placed part by part: no single device to move its group to
    model.hf_device_map = {"": "cpu"}  # one device: not split
    assert layer_devices(model, 4) is None
    model.hf_device_map = {"model.layers.0": 0, "model.layers.1": 0, "model.layers.2": "cpu", "model.layers.3": "disk"}
    assert [str(d) for d in layer_devices(model, 4)] == ["cuda:0"] * 4  # offloaded layers compute on the first GPU


def test_tp_outside_torchrun_says_how_to_start_it(capsys, tiny_model_folder, monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    code = main(["generate", "--model", str(tiny_model_folder), "--pipeline", "int4", "--prompt", "hi", "--tp", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "torchrun --nproc-per-node 2 -m kvweave.tools.cli ... --tp 2" in err


# ------------------------------------------------------------------------------------- two processes
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sections(text: str) -> dict[str, str]:
    parts: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("=== ") and not line.startswith("=== exit"):
            name = line[4:]
            parts[name] = ""
        elif line.startswith("=== exit"):
            parts[name + " exit"] = line.split()[-1]
        elif name is not None:
            parts[name] += line + "\n"
    return parts


PIPELINES = "full,int4,kivi-2,prerope-k4v2"
EVALUATED = "full,kivi-2"


def test_two_gloo_processes_match_one_process_and_only_rank_0_prints(tiny_model_folder, tmp_path, capsys):
    worker = Path(__file__).with_name("tp_worker.py")
    scratch = tmp_path / "scratch"  # the ranks' temporary folders: rank 1's copy of the results folder goes here
    scratch.mkdir()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
           "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1", "TMPDIR": str(scratch)}
    env.pop("KVWEAVE_TP_ALL_RANKS", None)
    procs = [subprocess.Popen([sys.executable, str(worker), str(tiny_model_folder), str(tmp_path), PIPELINES, EVALUATED],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(2)]
    try:  # meanwhile, the same commands in this process (no --tp): the reference
        import tp_worker

        single = {}
        for name in PIPELINES.split(","):
            assert main(tp_worker.generate_args(str(tiny_model_folder), name)) == 0
            single[name] = json.loads(capsys.readouterr().out)
        assert main(tp_worker.eval_args(str(tiny_model_folder), tmp_path / "single", EVALUATED)) == 0
        single_eval = json.loads(capsys.readouterr().out)
        outputs = [proc.communicate(timeout=300) for proc in procs]
    finally:
        for proc in procs:  # a rank left waiting on the other must not outlive the test
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], outputs[0][1][-3000:] + outputs[1][1][-3000:]
    assert outputs[1][0] == ""  # rank 1 printed nothing
    parts = _sections(outputs[0][0])
    for name in PIPELINES.split(","):
        assert parts[f"generate {name} exit"] == "0"
        sharded, alone = json.loads(parts[f"generate {name}"]), single[name]
        assert sharded["text"] == alone["text"] and alone["stats"]["generated_tokens"] == 24
        assert alone["stats"]["prompt_tokens"] == 191  # so that every compressing pipeline packs a block while decoding
        stats = sharded["stats"]
        assert stats["stored_bytes"] == alone["stats"]["stored_bytes"] == sum(stats["rank_bytes"]) and len(stats["rank_bytes"]) == 2
        assert stats["rank_bytes"][0] == stats["rank_bytes"][1]  # equal shares of the heads
        assert stats["full_16bit_bytes"] == alone["stats"]["full_16bit_bytes"] and stats["breakdown"] == alone["stats"]["breakdown"]
        assert alone["stats"]["rank_bytes"] == []
    table = json.loads(parts["eval"])
    for name in EVALUATED.split(","):
        ours, theirs = table["results"]["needle"]["pipelines"][name], single_eval["results"]["needle"]["pipelines"][name]
        assert [a["answer"] for a in ours["answers"]] == [a["answer"] for a in theirs["answers"]]
        assert [a["stored_bytes"] for a in ours["answers"]] == [a["stored_bytes"] for a in theirs["answers"]]
        speed, speed_alone = table["results"]["speed"]["pipelines"][name], single_eval["results"]["speed"]["pipelines"][name]
        assert speed["stored_bytes"] == speed_alone["stored_bytes"] and speed["generated_tokens"] == 6
    assert json.loads((tmp_path / "eval" / "settings.json").read_text())["settings"]["tp"] == 2
    assert parts["refused exit"] == "2" and "pipeline 'minicache', slot 'basis'" in outputs[0][1]
    assert outputs[0][1].count("pipeline 'minicache', slot 'basis'") == 1  # printed once
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["shard"] == [rank, 2] and record["kv_heads"] == 1 and record["query_heads"] == 2 and record["model_kv_heads"] == 2
        assert "pipeline 'freqdepthkv', slot 'probe'" in record["refusal"]
    assert not list(scratch.glob("kvweave-tp-rank*"))  # rank 1's copy of the results folder is gone


def test_every_builtin_component_declares_how_it_shards():
    """Each built-in component says on its class whether it works on a share of the KV heads (or why not),
    so a new one cannot be refused under tensor parallelism by omission."""
    from kvweave.core import plugins
    from kvweave.engine.sharding import POLICIES

    undeclared = []
    for info in (i for group in plugins.catalog().components.values() for i in group.values()):
        policy = info.factory.__dict__.get("head_sharding")
        if info.factory.__module__.startswith("kvweave.") and (policy is None or (policy not in POLICIES and len(policy) < 40)):
            undeclared.append(f"{info.group} '{info.name}'")
    assert not undeclared, undeclared
    assert check_shardable(load_pipeline("prerope-a3v2"), HeadShard(0, 2))["keys.quantizer"] == "head-local"
    assert check_shardable(load_pipeline("prerope-k4v2-lowbit"), HeadShard(0, 2))["kernel"] == "head-local"
