"""The repetition's attention split (engine/split_attention.py) checked on the GPU: its output and the parts'
log-sum-exp against float32 math (the repetition's own keys scaled up so they carry much of each row's mass), and how
much KVzip's scores move on the 32-layer Llama-3-8B-shaped random model (8K tokens) between three attentions of the
repetition: the split, one flash call, and the memory-efficient kernel (share of each layer, row and head's top half of
tokens that two of them agree on).

    python docs/perf/h200-2026-12-03-split/split_check.py      (from the repository's root, on a GPU)
"""
import sys, torch
sys.path.insert(0, "benchmarks")
from torch.nn.attention import sdpa_kernel, SDPBackend
from torch.nn.attention.bias import causal_lower_right
from kvweave.engine import importance
from kvweave.engine.split_attention import math_part, split_attention
import scoring_time, decode_e2e
torch.manual_seed(0)
B, Hq, H, F, T, D = 1, 32, 8, 2070, 8192, 128
q = torch.randn(B, Hq, F, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, H, T + F, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
k[..., T:, :] *= 3  # the own part carries much of the mass
s = D ** -0.5
ref, lse_ref = math_part(q, k, v, s, True)
got = split_attention(q, k, v, s)
one = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(F, T + F), scale=s, enable_gqa=True)
print("split err", (got.float() - ref).abs().max().item(), "one-call err", (one.float() - ref).abs().max().item(), "ref absmax", ref.abs().max().item())
kc = k[..., :T, :].repeat_interleave(4, 1); vc = v[..., :T, :].repeat_interleave(4, 1)
o1, l1 = torch.ops.aten._scaled_dot_product_cudnn_attention(q, kc, vc, None, True, 0.0, False, False, scale=s)[:2]
_, lm = math_part(q, k[..., :T, :], v[..., :T, :], s, False)
print("cudnn lse shape", tuple(l1.shape), l1.dtype, "max diff vs math", (l1.float().reshape(lm.shape) - lm).abs().max().item())
o2, l2 = torch.ops.aten._scaled_dot_product_flash_attention(q, k[..., T:, :].contiguous(), v[..., T:, :].contiguous(), 0.0, True, False, scale=s)[:2]
_, lm2 = math_part(q, k[..., T:, :], v[..., T:, :], s, True)
print("flash lse shape", tuple(l2.shape), "max diff vs math", (l2.float().reshape(lm2.shape) - lm2).abs().max().item())
# scores under three attentions of the repetition on the 32-layer random model, 8K tokens
model = decode_e2e.random_model(decode_e2e.llama3_8b(), "cuda")
tok = decode_e2e.Ids(model.config.vocab_size)
ids = torch.randint(100, model.config.vocab_size, (1, 8192), generator=torch.Generator().manual_seed(0)).cuda()
score = lambda: importance.reconstruction_scores(model, tok, ids, chunk=2048, backend="triton")
split_s = score()
importance.SPLIT_REPETITION = False
flash_s = score()
with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
    eff_s = score()
for name, a, b in [("split/flash", split_s, flash_s), ("efficient/flash", eff_s, flash_s), ("split/efficient", split_s, eff_s)]:
    print(name, "same top half", round(scoring_time.same_top_half(a, b), 4))
