"""GPU check of CUDA-graph decoding: tokens and cache bytes vs model.generate, on a small bf16 model with head_dim 128."""
import sys, time
sys.path.insert(0, "benchmarks")
import torch
from decode_e2e import Ids, random_model, smoke_config
from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs
from kvweave.engine.importance import score_for
from kvweave.engine.graphs import graph_decode
reg = load_registry("benchmarks/dense_sweep.toml")
model = random_model(smoke_config(4), "cuda")
model.generation_config.eos_token_id = None
name = "kzd-k4v2-f48-d128"
T, new, B = 300, 200, 2
ids = torch.randint(1, 512, (B, T), generator=torch.Generator().manual_seed(0)).cuda()
def prep():
    cache = build_cache(reg.resolve(name), model, tokenizer=Ids(512))
    score_for(model, cache, ids, False, None, ingest=True)
    return cache
cache = prep()
with torch.no_grad():
    ref = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))[:, T:]
cache2 = prep()
with torch.no_grad():
    first = model.generate(input_ids=ids, max_new_tokens=1, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache2))[:, T:]
replays = [0]
real = torch.cuda.CUDAGraph.replay
def counting(self):
    replays[0] += 1
    return real(self)
torch.cuda.CUDAGraph.replay = counting
t = time.time()
got = graph_decode(model, cache2, first, new - 1)
torch.cuda.synchronize()
print("graph decode s", time.time() - t, "replays", replays[0])
got = torch.cat((first, got), 1)
print("tokens equal", bool((ref == got).all()), int((ref != got).sum()), "first diff", (ref != got).float().argmax(-1).tolist())
print("bytes", cache.memory_bytes(), cache2.memory_bytes(), cache.get_seq_length(), cache2.get_seq_length())
va, vb = cache.engine.view(1), cache2.engine.view(1)
same = all(torch.equal(a, b) for a, b in zip(va.keys.coefficients.values(), vb.keys.coefficients.values()) if isinstance(a, torch.Tensor))
print("packed keys equal", same, "exact equal", torch.equal(va.keys.exact, vb.keys.exact))
