"""How much TF32 products would take off depthweave-kv's prompt products at 32K, and how far the results move.

    python benchmarks/tf32_products.py

One window's block of Llama-3-8B's shape (4 layers, B = 1, 8 KV heads, 32,768 tokens, head_dim 128; synthetic: rank 24
shared across the layers plus noise), on a CUDA GPU. Timed with ``torch.backends.cuda.matmul.allow_tf32`` off and on,
best of 5:
- the sketch basis's first state (``sketch-ema``'s ``init_state``);
- the residual basis fit (``begin_residual_fit(...).basis()``);
- the probe's keys and values measurements of the block.

Then the largest principal angle between the two settings' bases, and the probe's errors under each. Nothing in kvweave
turns TF32 on; this measures what it would change.
"""
import time
import torch
from kvweave.plugins.bases.sketch_ema import SketchEmaBasis
from kvweave.engine.residuals import begin_residual_fit
from kvweave.plugins.probes.attention_output import AttentionOutputProbe

torch.manual_seed(0)
G, B, H, N, D = 4, 1, 8, 32768, 128
factors = torch.randn(B, H, N, 24, device="cuda")
mixing = torch.randn(G, 1, H, 24, D, device="cuda")
block = (torch.einsum("bhnk,gxhkd->gbhnd", factors, mixing) + 0.3 * torch.randn(G, B, H, N, D, device="cuda")).to(torch.bfloat16)
work = block.float()
basis = SketchEmaBasis()
q = torch.randn(G, B, 32, 8, D, device="cuda")
approx_v = work + 0.05 * torch.randn_like(work)
context = (work[..., -96:, :].contiguous(), work[..., -96:, :].contiguous())

def timed(fn, reps=5):
    fn(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize(); t = time.perf_counter(); r = fn(); torch.cuda.synchronize(); out.append(time.perf_counter() - t)
    return min(out) * 1e3, r

def angle(a, b):
    qa, qb = torch.linalg.qr(a.double().transpose(-1, -2))[0], torch.linalg.qr(b.double().transpose(-1, -2))[0]
    s = torch.linalg.svdvals(qa.transpose(-1, -2) @ qb).clamp(max=1)
    return torch.rad2deg(torch.acos(s.min())).max().item()

results = {}
for tf32 in (False, True):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    ms_sketch, state = timed(lambda: basis.init_state(work))
    rows = work - work.mean(-2, keepdim=True)
    ms_fit, fitted = timed(lambda: begin_residual_fit(rows, 8).basis())
    probe = AttentionOutputProbe()
    def pair():
        shared = {}
        k = probe.measure_group(q, work, work, work + 0.05 * torch.randn_like(work), work, *context, None, shared=shared)
        v = probe.measure_group(q, work, work, work, approx_v, *context, None, shared=shared)
        return k, v
    ms_probe, errors = timed(pair)
    results[tf32] = (state["bases"][:, :, 0].float(), fitted.float(), errors)
    print(f"tf32={tf32}: sketch first state {ms_sketch:.2f} ms, residual fit {ms_fit:.2f} ms, probe pair {ms_probe:.2f} ms")
print("largest angle between the bases (degrees): sketch", round(angle(results[False][0], results[True][0]), 3),
      "residual", round(angle(results[False][1].flatten(0, -3), results[True][1].flatten(0, -3)), 3))
print("probe errors fp32 / tf32:", [e.mean().item() for e in results[False][2]], [e.mean().item() for e in results[True][2]])
