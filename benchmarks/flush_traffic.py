"""What one prompt flush of depthweave-kv moves through memory, and what its cache stores, on a CPU.

    python benchmarks/flush_traffic.py traffic [--tokens 1024]
    python benchmarks/flush_traffic.py save FILE      # the stored tensors of three depthweave pipelines
    python benchmarks/flush_traffic.py compare FILE   # this tree's against a file saved by another tree

``traffic``: a random bfloat16 model of Llama-3-8B's attention shape (8 KV heads of head_dim 128, 32 query heads) with
4 layers (one basis window) takes a prompt of ``--tokens`` + 64 tokens, and one flush runs under a dispatch mode that
counts, for every operation that launches work (views left out), the bytes of its inputs and outputs of at least an
eighth of the block, by operation and the two innermost kvweave lines that called it. Printed in float32 blocks (the
window's 4 layers of one kind in float32), keys and values together, largest first: where the flush's passes over the
block are. Sizes, not times: the GPU's times by operation are ``profile_prefill.py --ops``'s.

``save`` / ``compare``: depthweave-kv, its no-cross-depth and layer-share ablations, each over a 700-token prompt and 40
generated tokens on an 8-layer model of the same shape; every tensor their caches store (``tests/test_graphs.py``'s
list), the tokens and the bytes by part. ``compare`` says, per pipeline, whether this tree stores bit for bit what the
saved tree stored: how a change that should not move a bit is checked.
"""

from __future__ import annotations

import argparse
import collections
import sys
import traceback
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig, LlamaForCausalLM

from kvweave.engine import build_cache, cache_kwargs

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from test_graphs import _depthweave_stored, _Vocabulary  # noqa: E402

VIEWS = {"view", "select", "slice", "expand", "transpose", "permute", "unsqueeze", "unbind", "_unsafe_view", "alias",
         "t", "squeeze", "split", "split_with_sizes", "narrow", "as_strided", "detach", "lift_fresh", "diagonal"}
PIPELINES = ("depthweave-kv", "depthweave-kv-no-cross-depth", "depthweave-kv-layer-share")


def model(layers: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=1024, intermediate_size=512, num_hidden_layers=layers,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    net = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    net.generation_config.eos_token_id = None
    return net


class Traffic(TorchDispatchMode):
    """Bytes in and out of each operation touching tensors of at least ``smallest`` elements, by operation and caller."""

    def __init__(self, smallest: int) -> None:
        super().__init__()
        self.smallest = smallest
        self.bytes: collections.Counter = collections.Counter()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in VIEWS:
            return out
        outs = out if isinstance(out, (tuple, list)) else [out]
        big = [t for t in (*outs, *args) if isinstance(t, torch.Tensor) and t.numel() >= self.smallest]
        if big:
            ours = [f for f in traceback.extract_stack() if str(ROOT) in f.filename and "flush_traffic" not in f.filename]
            where = " < ".join(f"{Path(f.filename).relative_to(ROOT)}:{f.lineno}" for f in ours[-2:][::-1])
            key = (str(func).removeprefix("aten."), where)
            self.bytes[key] += sum(t.numel() * t.element_size() for t in big)
            self.calls[key] += 1
        return out


def traffic(tokens: int) -> None:
    net = model(4)
    cache = build_cache("depthweave-kv", net, tokenizer=_Vocabulary())
    engine = cache.engine
    block = 4 * 8 * tokens * 128  # the window's elements of one kind
    mode, flush = Traffic(block // 8), engine._flush

    def traced(group):
        with mode:
            flush(group)

    engine._flush = traced
    with torch.no_grad():
        net(input_ids=torch.randint(1, 128, (1, tokens + 64)), use_cache=True, **cache_kwargs(net, cache))
    unit = block * 4
    print("| float32 blocks | calls | operation | called at |\n|---:|---:|---|---|")
    for key, moved in mode.bytes.most_common():
        print(f"| {moved / unit:.2f} | {mode.calls[key]} | {key[0]} | {key[1]} |")
    print(f"\n{sum(mode.bytes.values()) / unit:.1f} float32 blocks moved by one flush of keys and values ({tokens} tokens)")


def stored() -> dict:
    net, found = model(8), {}
    for name in PIPELINES:
        cache = build_cache(name, net, tokenizer=_Vocabulary())
        ids = torch.randint(1, 128, (1, 700), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            tokens = net.generate(input_ids=ids, max_new_tokens=40, do_sample=False, **cache_kwargs(net, cache))
        found[name] = ([t.clone() for t in _depthweave_stored(cache)], tokens, cache.memory_breakdown())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("traffic", "save", "compare"))
    parser.add_argument("file", nargs="?", help="where save writes, what compare reads")
    parser.add_argument("--tokens", type=int, default=1024, help="the flushed block's tokens (traffic)")
    args = parser.parse_args()
    if args.what == "traffic":
        traffic(args.tokens)
        return
    if args.file is None:
        parser.error(f"{args.what} needs a FILE")
    if args.what == "save":
        torch.save(stored(), args.file)
        print(f"saved {', '.join(PIPELINES)} to {args.file}")
        return
    before, now = torch.load(args.file), stored()
    for name in PIPELINES:
        old, new = before[name], now[name]
        same = len(old[0]) == len(new[0]) and all(a.shape == b.shape and torch.equal(a, b) for a, b in zip(old[0], new[0]))
        print(f"{name}: {len(new[0])} stored tensors, bit for bit the same: {same}; the same tokens: "
              f"{torch.equal(old[1], new[1])}; the same bytes by part: {old[2] == new[2]}")


if __name__ == "__main__":
    main()
