"""The dense kernel's launch settings timed on one packed view, each setting twice in turn (run from the repository's
root on a GPU machine):

    python docs/perf/h200-2026-12-04-splits/launch_settings.py k4v2e48t 128 65536 3:128:4096,3:96:8192

Arguments: a storage of ``benchmarks/lowbit_kernel.py`` (read with its keys after RoPE), the batch, the context, then
comma-separated ``stages:maxnreg:programs`` settings (software-pipeline stages, a thread's register cap, the programs
aimed for: ceil(programs / (B x 8 KV heads)) splits a row). Prints each setting's GPU time, its speed-up over SDPA on
the full bf16 cache, its share of the copy bandwidth and its largest difference from the first setting's output."""

import sys

sys.path.insert(0, "benchmarks")

import attrs  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kvweave.kernels.lowbit_decode as decode  # noqa: E402
from decode_kernel import copy_bandwidth, device_us  # noqa: E402
from lowbit_kernel import HEAD_DIM, KV_HEADS, Q_HEADS, WINDOW, packed_view, view_bytes  # noqa: E402

SETTING: dict = {}
_dense_launch = decode.dense_launch


def _with_setting(*args, **kwargs):
    """The dense launch with the setting's stages and register cap."""
    kernel, grid, arguments, constants = _dense_launch(*args, **kwargs)
    return kernel, grid, arguments, {**constants, "maxnreg": SETTING["maxnreg"], "num_stages": SETTING["stages"]}


def main() -> None:
    decode.dense_launch = _with_setting
    storage, batch, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    settings = [tuple(int(x) for x in item.split(":")) for item in sys.argv[4].split(",")]
    bandwidth = copy_bandwidth()
    view = attrs.evolve(packed_view(batch, tokens, storage=storage), inv_freq=None)
    q = torch.randn(batch, Q_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    keys = torch.randn(batch, KV_HEADS, tokens + WINDOW, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    values = torch.randn_like(keys)
    sdpa = device_us(lambda: F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True), 10)
    del keys, values
    read = view_bytes(view)
    print(f"{storage} B={batch} T={tokens} SDPA {sdpa:.1f} us, read {read / 1e6:.1f} MB, copy bw {bandwidth / 1e12:.2f} TB/s")
    print("| stages | maxnreg | programs | us | speed-up | % copy bw | max diff |")
    reference = None
    for _ in range(2):
        for stages, registers, programs in settings:
            SETTING.update(stages=stages, maxnreg=registers)
            call = lambda: decode.lowbit_decode(view, q, None, HEAD_DIM ** -0.5, 64, 4, "dense", programs)  # noqa: E731
            out = call().float()
            reference = out if reference is None else reference
            us = device_us(call, 10)
            print(f"| {stages} | {registers} | {programs} | {us:.1f} | {sdpa / us:.2f}x | "
                  f"{100 * read / (us * 1e-6) / bandwidth:.0f}% | {float((out - reference).abs().max()):.1e} |", flush=True)


if __name__ == "__main__":
    main()
