import torch, time
from torch.nn.attention.bias import causal_lower_right
B, Hq, H, F, T, D = 1, 32, 8, 2070, 32768, 128
q = torch.randn(B, Hq, F, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, H, T + F, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
s = D ** -0.5
def rep():
    kk, vv = k.repeat_interleave(4, dim=1), v.repeat_interleave(4, dim=1)
    return torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=causal_lower_right(F, T + F), scale=s)
def direct():
    return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=s)[0]
def gqa():
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(F, T + F), scale=s, enable_gqa=True)
def split():  # context part non-causal via cudnn/any + repetition causal, merged by lse
    o1, l1 = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k[..., :T, :].repeat_interleave(4, 1), v[..., :T, :].repeat_interleave(4, 1), None, True, 0.0, False, False, scale=s)[:2]
    return o1
for name, fn in [("repeat+sdpa", rep), ("aten flash gqa", direct), ("sdpa enable_gqa", gqa), ("cudnn ctx only", split)]:
    try:
        out = fn(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(10): out = fn()
        torch.cuda.synchronize()
        ref = rep()
        err = (out.float() - ref.float()).abs().max().item() if out.shape == ref.shape else float("nan")
        print(f"{name}: {(time.perf_counter() - t) / 10 * 1e3:.2f} ms, max diff vs repeat {err:.3g}", flush=True)
    except Exception as e:
        print(f"{name}: failed {type(e).__name__}: {str(e)[:200]}", flush=True)
