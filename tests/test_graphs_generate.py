"""CUDA graph decoding where users reach it: ``kvweave.engine.generation.generate(..., cuda_graphs=True)`` (what
``kvweave generate --cuda-graphs`` runs), the default model answering with it, and ``kvweave eval speed
--speed-cuda-graphs``. On a CPU the steps run without capture (the window's put in torch);
tests/test_graphs.py has the parts and the capture on a GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvweave.core.errors import CacheStateError
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache

from conftest import CharTokenizer, tiny_llama
from test_graphs import FRONTIER


@pytest.mark.interpreter
@pytest.mark.parametrize("ends", [False, True])
def test_kvweave_generate_with_cuda_graphs_returns_what_it_returns_without(ends):
    """``kvweave.engine.generation.generate(..., cuda_graphs=True)`` (steps eager on a CPU): the same new tokens and
    stored bytes; with the model's end-of-sequence id in play, rows that end are padded as ``model.generate`` pads."""
    from kvweave.engine.generation import generate

    net = tiny_llama(torch.float32, hidden=256, layers=2)
    net.generation_config.eos_token_id = 114 if ends else None  # 114: both rows decode it, at steps 2 and 24
    ids = torch.randint(1, 128, (2, 90), generator=torch.Generator().manual_seed(1))
    runs = []
    for graphs in (False, True):
        cache = build_cache(load_registry(FRONTIER).resolve("kzd-k4v2-f48"), net, tokenizer=CharTokenizer())
        runs.append(generate(net, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache, max_new_tokens=70,
                             do_sample=False, pad_token_id=0, cuda_graphs=graphs))
    (plain, plain_stats), (graphed, graphed_stats) = runs
    assert torch.equal(plain, graphed)
    assert plain_stats.stored_bytes == graphed_stats.stored_bytes and plain_stats.cached_tokens == graphed_stats.cached_tokens
    assert plain.shape[1] < 70 if ends else plain.shape[1] == 70
    if ends:
        assert (plain == 0).any()  # a row that ended first is padded


_PLAIN_CPU = """
import os, sys
os.environ["TRITON_INTERPRET"] = "0"  # a CPU user's process: Triton cannot launch here
sys.path.insert(0, "tests")
import torch
from conftest import CharTokenizer, tiny_llama
from test_graphs import FRONTIER
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache
from kvweave.engine.generation import generate

net = tiny_llama(torch.float32, hidden=256, layers=2)
net.generation_config.eos_token_id = None
ids = torch.randint(1, 128, (1, 90), generator=torch.Generator().manual_seed(1))
runs = []
for graphs in (False, True):
    cache = build_cache(load_registry(FRONTIER).resolve("kzd-k4v2-f48"), net, tokenizer=CharTokenizer())
    runs.append(generate(net, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, cache, max_new_tokens=40,
                         do_sample=False, pad_token_id=0, cuda_graphs=graphs))
print(torch.equal(runs[0][0], runs[1][0]), runs[0][1].stored_bytes == runs[1][1].stored_bytes, runs[1][0].shape[1])
"""


def test_cuda_graph_decoding_runs_on_a_cpu_where_triton_cannot_launch():
    """A CPU user's process (no Triton interpreter): ``generate(..., cuda_graphs=True)`` decodes what it decodes
    without, the kept int8 window taking each token by the put kernel's arithmetic in torch (it failed there with
    Triton's "0 active drivers" before)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _PLAIN_CPU], capture_output=True, text=True, timeout=600, cwd=root, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-3:] == ["True", "True", "40"]


def test_kvweave_generate_refuses_what_cuda_graphs_cannot_decode():
    from kvweave.engine.generation import generate

    net = tiny_llama(torch.float32, hidden=256, layers=2)
    ids = torch.randint(1, 128, (2, 20), generator=torch.Generator().manual_seed(1))
    cache = build_cache(load_registry(FRONTIER).resolve("kzd-k4v2-f48"), net, tokenizer=CharTokenizer())
    with pytest.raises(ValueError, match="greedy, do_sample"):
        generate(net, {"input_ids": ids}, cache, max_new_tokens=5, do_sample=True, cuda_graphs=True)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(CacheStateError, match="padding"):
        generate(net, {"input_ids": ids, "attention_mask": mask}, cache, max_new_tokens=5, cuda_graphs=True)
    reference = build_cache(load_registry().resolve("kvzip-qa35v3"), net, tokenizer=CharTokenizer())
    with pytest.raises(CacheStateError, match="kernel 'reference'"):
        generate(net, {"input_ids": ids}, reference, max_new_tokens=5, cuda_graphs=True)
    assert cache.get_seq_length() == reference.get_seq_length() == 0  # refused before the prefill


@pytest.mark.model
@pytest.mark.interpreter
def test_the_default_model_answers_the_same_with_cuda_graph_decoding(real_model):
    """SmolLM2-135M with ``kzd-k4v2-f48`` over the 725-token report (steps eager on a CPU): the same answer, tokens,
    stored bytes and cached tokens, the end of sequence found as ``model.generate`` finds it."""
    from kvweave.engine.generation import generate

    model, tokenizer = real_model
    text = (Path(__file__).resolve().parent.parent / "examples" / "prompts" / "harbour-report.txt").read_text()
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    runs = []
    for graphs in (False, True):
        cache = build_cache(load_registry(FRONTIER).resolve("kzd-k4v2-f48"), model, tokenizer=tokenizer)
        runs.append(generate(model, inputs, cache, max_new_tokens=40, do_sample=False, temperature=None, top_p=None,
                             top_k=None, pad_token_id=tokenizer.pad_token_id, cuda_graphs=graphs))
    (plain, plain_stats), (graphed, graphed_stats) = runs
    assert torch.equal(plain, graphed) and plain.shape[1] < 40  # it ended before the limit
    assert "silver heron" in tokenizer.decode(graphed[0], skip_special_tokens=True)
    assert (plain_stats.stored_bytes, plain_stats.cached_tokens) == (graphed_stats.stored_bytes, graphed_stats.cached_tokens)


@pytest.mark.interpreter
def test_eval_speed_decodes_from_graphs_where_a_pipeline_allows_it_and_says_which(tokenizer, tmp_path, capsys):
    """``kvweave eval speed --speed-cuda-graphs`` (steps eager on a CPU): the lowbit pipeline decodes from graphs, the
    full cache as without and says why, the table has a column for it, and a folder made without the option is refused."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from kvweave.tools import cli

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    folder = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(folder)  # head_dim 64, what the lowbit kernel reads
    tokenizer.save_pretrained(folder)
    out = tmp_path / "speed"
    args = ["eval", "speed", "--model", str(folder), "--pipelines", "full,kzd-k4v2-f48", "--registry", str(FRONTIER),
            "--speed-tokens", "128", "--speed-new-tokens", "12", "--dtype", "float32", "--out", str(out)]
    assert cli.main([*args, "--speed-cuda-graphs"]) == 0
    speed = json.loads((out / "speed.json").read_text())["pipelines"]
    assert speed["kzd-k4v2-f48"]["decoded"] == "cuda graphs" and "eager_because" not in speed["kzd-k4v2-f48"]
    assert speed["full"]["decoded"] == "eager" and "kernel 'reference'" in speed["full"]["eager_because"]
    assert all(speed[name]["decode_tokens_per_second"] > 0 for name in speed)
    table = capsys.readouterr().out
    assert "| decoded |" in table and table.count("| eager |") == 1 and table.count("| cuda graphs |") == 1
    assert cli.main(args) == 2  # the folder holds a run with CUDA graphs: another without them is refused
    assert "other settings" in capsys.readouterr().err
