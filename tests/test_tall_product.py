"""Products summed over a long token axis in chunks (core/linalg.py ``tall_product``) and the prompt's stages that use
them on a GPU: the sketch's range finder, the residual basis fit and the probe. The chunks are chosen on CUDA tensors
only; here they are forced (``chunk=`` or a patched ``tall_chunk``) and compared with the one product they replace."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvweave.core import linalg
from kvweave.core.linalg import _chunks, float32_product, tall_chunk, tall_gram, tall_product
from kvweave.engine.residuals import begin_residual_fit
from kvweave.plugins.bases._sketch import _gaussian, _range_finder_gram
from kvweave.plugins.probes.attention_output import AttentionOutputProbe

from test_linalg import sine_angle as largest_angle


@pytest.mark.parametrize("tokens", [4096, 4099, 3000, 1500])
@pytest.mark.parametrize("chunk", [0, 256, 1000])
def test_tall_product_equals_one_product(tokens, chunk):
    torch.manual_seed(tokens + chunk)
    a = torch.randn(2, 1, tokens, 24, dtype=torch.float64)
    b = torch.randn(1, 3, tokens, 40, dtype=torch.float64)  # leading dimensions broadcast
    out = tall_product(a, b, chunk)
    assert out.shape == (2, 3, 24, 40)
    torch.testing.assert_close(out, a.transpose(-1, -2) @ b, rtol=1e-12, atol=1e-10)


def test_tall_product_reads_a_transposed_operand():
    """The probe's ``weights @ values``: the weights [..., rows, n] passed transposed."""
    torch.manual_seed(0)
    weights = torch.randn(4, 8, 32, 5001, dtype=torch.float64)
    values = torch.randn(4, 8, 5001, 16, dtype=torch.float64)
    torch.testing.assert_close(tall_product(weights.transpose(-1, -2), values, 512), weights @ values,
                               rtol=1e-12, atol=1e-10)


def test_tall_product_refuses_bad_input():
    with pytest.raises(ValueError, match="token axes differ"):
        tall_product(torch.zeros(10, 2), torch.zeros(11, 2))
    with pytest.raises(ValueError, match="chunk must be >= 0"):
        tall_product(torch.zeros(10, 2), torch.zeros(10, 2), -4)


def test_tall_gram_is_the_float32_gram_matrix_of_any_dtype_on_a_cpu():
    torch.manual_seed(1)
    a = torch.randn(2, 3, 700, 24).to(torch.bfloat16)
    out = tall_gram(a)
    assert out.dtype == torch.float32 and out.shape == (2, 3, 24, 24)
    assert torch.equal(out, tall_product(a.float(), a.float()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the 16-bit products run on a CUDA GPU")
@pytest.mark.parametrize("batch,tokens,width", [(8, 32768, 512), (32, 32771, 128), (1, 3000, 64), (8, 200, 512)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tall_gram_of_a_16_bit_block_on_a_gpu_is_its_float32_gram_matrix(batch, tokens, width, dtype):
    """Chunked or not, with a rest or not: the exact Gram matrix of the 16-bit values to float32 summation, as near it
    as the float32 copy's product (16-bit sums over 32K tokens would be off by ~1e-2)."""
    torch.manual_seed(tokens)
    a = torch.randn(batch, tokens, width, device="cuda").to(dtype)
    out = tall_gram(a)
    assert out.dtype == torch.float32 and out.shape == (batch, width, width)
    exact = tall_product(a.double(), a.double(), 0)
    error = ((out.double() - exact).abs().max() / exact.abs().max()).item()
    copy = ((tall_product(a.float(), a.float()).double() - exact).abs().max() / exact.abs().max()).item()
    assert error < 2e-4 and error < 10 * copy + 1e-6, (error, copy)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the 16-bit products run on a CUDA GPU"))])
def test_float32_product_of_16_bit_operands_is_their_float32_values_product(device):
    """The observer's logits: 16-bit queries times a 16-bit window's keys (transposed, as the window lies), float32
    out; on a GPU multiplied as they are, to float32 summation of their exact products."""
    torch.manual_seed(2)
    queries = torch.randn(2, 8, 32, 128, device=device).bfloat16()
    keys = torch.randn(2, 8, 5000, 128, device=device).bfloat16()
    out = float32_product(queries, keys.transpose(-1, -2))
    assert out.dtype == torch.float32 and out.shape == (2, 8, 32, 5000)
    exact = queries.double() @ keys.double().transpose(-1, -2)
    if device == "cpu":
        assert torch.equal(out, queries.float() @ keys.float().transpose(-1, -2))
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 1e-5


@pytest.mark.parametrize("tokens", [32640, 32767, 32768, 32771, 2048, 3001])
def test_chunks_divide_the_axis_where_a_count_can(tokens):
    parts, length = _chunks(tokens, 1024)
    assert parts >= 2 and parts * length <= tokens
    if any(tokens % count == 0 for count in range(tokens // 2048 + 1, tokens // 1024 + 1)):
        assert parts * length == tokens and 1024 <= length < 2048  # no rest: a contiguous input is a view
    else:
        assert length == 1024 and tokens - parts * length < 1024


def test_tall_chunk_only_on_a_gpu_and_long_axes(monkeypatch):
    monkeypatch.setattr(linalg, "TALL_CHUNK", 1024)
    assert tall_chunk(torch.device("cpu"), 32768) == 0
    assert tall_chunk(torch.device("cuda"), 32768) == 1024
    assert tall_chunk(torch.device("cuda", 1), 2048) == 1024
    assert tall_chunk(torch.device("cuda"), 2047) == 0  # fewer than two chunks: one product
    monkeypatch.setattr(linalg, "TALL_CHUNK", 0)
    assert tall_chunk(torch.device("cuda"), 32768) == 0


@pytest.mark.parametrize("value,ok", [("2048", True), ("0", True), ("1000", False), ("big", False)])
def test_the_environment_sets_the_chunk_or_is_refused(value, ok):
    env = {**os.environ, "KVWEAVE_TALL_CHUNK": value}
    run = subprocess.run([sys.executable, "-c", "from kvweave.core import linalg; print(linalg.TALL_CHUNK)"], env=env,
                         capture_output=True, text=True)
    if ok:
        assert run.returncode == 0 and run.stdout.strip() == value
    else:
        assert run.returncode != 0 and "KVWEAVE_TALL_CHUNK" in run.stderr


def force_chunks(monkeypatch) -> None:
    """Every ``tall_product`` without an explicit chunk cuts 256-token chunks from here on, as a GPU would (on this
    CPU)."""
    monkeypatch.setattr(linalg, "tall_chunk", lambda device, tokens: 256 if tokens >= 512 else 0)


def low_rank_block(tokens: int, seed: int = 0) -> torch.Tensor:
    """A block [G = 2, B = 1, H = 2, n, D = 64] of rank-6 keys plus noise, bfloat16 values in float32."""
    torch.manual_seed(seed)
    factors = torch.randn(1, 2, tokens, 6)
    mixing = torch.randn(2, 1, 2, 6, 64)
    block = torch.einsum("bhnk,gxhkd->gbhnd", factors, mixing) + 0.1 * torch.randn(2, 1, 2, tokens, 64)
    return block.to(torch.bfloat16).float()


def test_the_sketch_range_finder_gives_the_same_basis_in_chunks(monkeypatch):
    rows = low_rank_block(3001).permute(1, 2, 3, 0, 4).reshape(1, 2, 3001, 128) / 3001**0.5
    omega = _gaussian((128, 14), 5, rows.device)
    whole = _range_finder_gram(rows, omega, 6, 2)
    force_chunks(monkeypatch)
    parts = _range_finder_gram(rows, omega, 6, 2)
    assert whole is not None and parts is not None
    assert largest_angle(whole[0], parts[0]) < 1e-3
    torch.testing.assert_close(parts[1], whole[1], rtol=1e-5, atol=1e-6)


def test_the_residual_fit_gives_the_same_moment_and_basis_in_chunks(monkeypatch):
    missing = low_rank_block(2600, seed=1)
    whole = begin_residual_fit(missing, 4)
    force_chunks(monkeypatch)
    parts = begin_residual_fit(missing, 4)
    torch.testing.assert_close(parts.moment, whole.moment, rtol=1e-5, atol=1e-3)
    assert largest_angle(whole.basis().flatten(0, -3), parts.basis().flatten(0, -3)) < 0.1  # float16 bases


def test_the_probe_measures_the_same_errors_in_chunks(monkeypatch):
    block = low_rank_block(2600, seed=2)
    torch.manual_seed(3)
    queries = torch.randn(2, 1, 8, 4, 64)
    approx_keys, approx_values = block + 0.05 * torch.randn_like(block), block + 0.05 * torch.randn_like(block)
    context = (block[..., -48:, :].contiguous(), block[..., -48:, :].contiguous())
    probe = AttentionOutputProbe()

    def pair():
        shared: dict = {}
        keys = probe.measure_group(queries, block, block, approx_keys, block, *context, None, shared=shared)
        values = probe.measure_group(queries, block, block, block, approx_values, *context, None, shared=shared)
        both = probe.measure_group(queries, block, block, approx_keys, approx_values, *context, None)
        return torch.stack((keys, values, both))

    whole = pair()
    force_chunks(monkeypatch)
    parts = pair()
    assert (whole > 1e-3).all()  # the errors measured are not zero
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-7)


def test_the_benchmark_builds_its_block_measures_angles_and_refuses_a_machine_without_a_gpu():
    """benchmarks/tall_products.py: its block and angle on this CPU; without CUDA it says so instead of timing."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "benchmarks"))
    import tall_products

    case = tall_products.block_case(96, device="cpu")
    assert case["work"].shape == (4, 1, 8, 96, 128) and case["queries"].shape == (4, 1, 32, 8, 128)
    assert torch.equal(case["work"], case["work"].bfloat16().float())  # bfloat16 values, as a model's keys
    torch.manual_seed(5)
    basis = torch.linalg.qr(torch.randn(2, 64, 6, dtype=torch.float64))[0].transpose(-1, -2)
    turned = torch.linalg.qr((basis + 0.001 * torch.randn_like(basis)).transpose(-1, -2))[0].transpose(-1, -2)
    assert tall_products.angle(basis, basis) < 1e-6 < tall_products.angle(basis, turned) < 5
    if not torch.cuda.is_available():
        run = subprocess.run([sys.executable, str(root / "benchmarks" / "tall_products.py"), "--tokens", "64"],
                             capture_output=True, text=True)
        assert run.returncode != 0 and "no CUDA GPU" in run.stderr
