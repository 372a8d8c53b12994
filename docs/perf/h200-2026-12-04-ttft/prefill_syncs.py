"""Where a prompt's forward stops the host for the GPU: ``torch.cuda.set_sync_debug_mode("warn")`` during one first
token of a compressing pipeline (Llama-3-8B's shape, random weights, as ``benchmarks/profile_prefill.py``), every
synchronizing call counted by the kvweave lines that made it.

    python docs/perf/h200-2026-12-04-ttft/prefill_syncs.py [--pipeline l-qa35v3 | full] [--registry benchmarks/lean_sweep.toml] [--tokens 32768] [--layers 4]
"""

import argparse
import sys
import traceback
import warnings
from collections import Counter

import torch
from transformers import DynamicCache

sys.path.insert(0, "benchmarks")
from decode_e2e import Ids, llama3_8b, random_model  # noqa: E402
from profile_prefill import first_token  # noqa: E402

from kvweave.core.registry import load_pipeline  # noqa: E402
from kvweave.engine import build_cache  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--pipeline", default="l-qa35v3")
parser.add_argument("--registry", default="benchmarks/lean_sweep.toml")
parser.add_argument("--tokens", type=int, default=32768)
parser.add_argument("--layers", type=int, default=4)
args = parser.parse_args()

model = random_model(llama3_8b(args.layers), "cuda")
model.set_attn_implementation("sdpa")
ids = torch.randint(0, model.config.vocab_size, (1, args.tokens), device="cuda")
if args.pipeline == "full":  # the baseline: transformers' own cache
    fresh = lambda: DynamicCache(config=model.config)  # noqa: E731
else:
    fresh = lambda: build_cache(load_pipeline(args.pipeline, args.registry), model, tokenizer=Ids(model.config.vocab_size))  # noqa: E731
first_token(model, fresh(), ids)  # compiled, allocator grown
sites: Counter = Counter()


def seen(message, category, filename, lineno, file=None, line=None):
    frames = [f for f in traceback.extract_stack()[:-1] if "/kvweave/" in f.filename or "/work/" in f.filename]
    frames = [f for f in frames if "warnings" not in f.filename][-3:]
    sites[" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in reversed(frames))] += 1


warnings.showwarning = seen
warnings.simplefilter("always")
cache = fresh()
torch.cuda.set_sync_debug_mode("warn")
first_token(model, cache, ids)
torch.cuda.set_sync_debug_mode(0)
print(f"{args.pipeline}, {args.layers} layers, {args.tokens} tokens: {sum(sites.values())} synchronizing calls")
for site, count in sites.most_common():
    print(f"{count:4d}  {site}")
