"""How the ``tiles`` pass (kernels/depthweave_tiles_triton.py) turns its int8 coefficients into float16 operands: four
codes a register by byte permutes on a GPU (``TILES_BYTES``), its arithmetic replayed here for every code; the value
coefficients loaded token-major and transposed once float16 (``TILES_ROWS``) against the transposed int8 load, under
the interpreter; both on the GPU against the conversion a code, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import attrs
import numpy as np
import pytest
import torch

from kvweave.kernels import depthweave_decode
from kvweave.kernels.decode_torch import torch_decode
from kvweave.kernels.depthweave_decode import fused_decode
from kvweave.kernels.gpu_build import nvdisasm

from test_lowbit_kernel_host import _nvidia_backend, compile_job
from test_tiles_pass import _tiles_case, recorded_tiles_job, recorded_tiles_launches

#: the inline assembly's constants (kernels/depthweave_operands_triton.py ``_coefficients``)
FLIP, EXPONENT, LOW, HIGH, BIAS = 0x80808080, 0x64646464, 0x4140, 0x4342, 0x64806480


def _prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32`` (the default mode): byte ``i`` of the result is the byte of ``{b, a}`` named by nibble ``i`` of
    ``selector`` (bits 0-2; bit 3 replicates that byte's sign bit)."""
    pool = (b << 32) | a
    out = 0
    for i in range(4):
        nibble = (selector >> (4 * i)) & 15
        byte = (pool >> (8 * (nibble & 7))) & 0xFF
        if nibble & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << (8 * i)
    return out


def _halves(word: int) -> np.ndarray:
    """The two float16 numbers of a 32-bit word, the low half first."""
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def test_the_byte_permutes_make_every_int8_code_its_float16_number():
    """Replayed for all 256 codes, four to a word in each byte place: the exclusive or, the two permutes and the paired
    subtraction of 1152 give each code, in its place (elements 0, 1 in the first output register, 2, 3 in the
    second), as the float16 number a conversion gives. A wrong selector, exponent byte or bias fails."""
    codes = np.arange(-128, 128, dtype=np.int8)
    bias = _halves(BIAS)
    assert bias.tolist() == [1152.0, 1152.0]
    for shift in range(4):
        quads = np.roll(codes, shift).reshape(-1, 4)
        for quad in quads:
            word = int(quad.view(np.uint32)[0]) ^ FLIP
            first = _halves(_prmt(word, EXPONENT, LOW)) - bias
            second = _halves(_prmt(word, EXPONENT, HIGH)) - bias
            made = np.concatenate([first, second])
            assert made.dtype == np.float16
            np.testing.assert_array_equal(made, quad.astype(np.float16))


@pytest.mark.parametrize("name, block", [("dw-kernel", 32), ("dw-kernel-blocks", 64), ("dw-kernel-wide", 64)])
def test_value_coefficients_read_token_major_give_the_same_sums(tmp_path, monkeypatch, name, block):
    """``TILES_ROWS`` loads a step's value coefficients as the keys' are and transposes them once float16: the same
    output as the transposed int8 load (within float32 rounding) and as the twin, with one scale a token and with a
    scale a block of 8 coefficients (``dw-kernel-blocks``), at 32- and 64-token steps and head_dim 64."""
    view, query, start, dim = _tiles_case(tmp_path, name)
    run = lambda: fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block, variant="tiles")  # noqa: E731
    monkeypatch.setattr(depthweave_decode, "TILES_WORDS", 0)  # the byte loads (words need the values token-major)
    monkeypatch.setattr(depthweave_decode, "TILES_ROWS", False)
    transposed = run()
    monkeypatch.setattr(depthweave_decode, "TILES_ROWS", True)
    rows = run()
    assert (rows - transposed).abs().max().item() < 1e-5
    assert (rows - torch_decode(view, query, start, dim**-0.5)).abs().max().item() < 1e-3


@pytest.mark.parametrize("name, block, words", [("dw-kernel", 64, 1), ("dw-kernel", 32, 2), ("dw-kernel-wide", 64, 2)])
def test_coefficient_codes_read_as_words_give_the_same_sums(tmp_path, monkeypatch, name, block, words):
    """``TILES_WORDS`` loads the codes as 32-bit words, four a word, at the step's start (1) or a step ahead (2), and
    cuts them into float16 operands in code order: the same output as the int8 loads and the twin's, at 32- and
    64-token steps, head_dim 64, over segments of 96 tokens (a last step whose next one lies past the segment)."""
    view, query, start, dim = _tiles_case(tmp_path, name)
    run = lambda: fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block, variant="tiles")  # noqa: E731
    monkeypatch.setattr(depthweave_decode, "TILES_WORDS", 0)
    plain = run()
    monkeypatch.setattr(depthweave_decode, "TILES_WORDS", words)
    switched = run()
    assert (switched - plain).abs().max().item() < 1e-5
    assert (switched - torch_decode(view, query, start, dim**-0.5)).abs().max().item() < 1e-3


def test_codes_are_read_as_words_only_where_they_can_be(tmp_path):
    """Word loads need one scale a token, a rank of whole words and word-aligned codes: a layer with a scale a block
    of 8 coefficients, or codes at an odd address, keeps the byte loads."""
    view, _, _, _ = _tiles_case(tmp_path, "dw-kernel")
    constants = {"R": view.k_codes.shape[-1], "RB": view.block}
    assert depthweave_decode.word_codes(view, constants)
    assert not depthweave_decode.word_codes(view, {**constants, "RB": 8})

    def placed(codes, offset):  # a contiguous copy of ``codes`` starting ``offset`` bytes into a fresh buffer
        buffer = torch.zeros(codes.numel() + 8, dtype=codes.dtype, device=codes.device)
        return buffer[offset:offset + codes.numel()].view(codes.shape).copy_(codes)

    aligned = attrs.evolve(view, k_codes=placed(view.k_codes, 0), v_codes=placed(view.v_codes, 0))
    assert depthweave_decode.word_codes(aligned, constants)
    odd = attrs.evolve(view, k_codes=placed(view.k_codes, 1), v_codes=placed(view.v_codes, 1))
    assert not depthweave_decode.word_codes(odd, constants)


def test_the_decode_reads_words_and_the_flush_statistics_bytes(tmp_path):
    """``TILES_WORDS`` (2 by default, timed on decode) is the decode pass's: a flush's statistics pass, 32 query rows a
    KV head and no values, keeps the byte loads it was timed with."""
    view, query, _, dim = _tiles_case(tmp_path, "dw-kernel")
    launches = recorded_tiles_launches(lambda: (
        fused_decode(view, query, None, dim**-0.5, variant="tiles"),
        depthweave_decode.fused_packed_logsumexp(view, query.repeat(1, 4, 1), dim**-0.5, variant="tiles")))
    assert depthweave_decode.TILES_WORDS == 2
    assert [(constants["VALUES"], constants["WORDS"]) for _, constants in launches] == [(True, 2), (False, 0)]


#: the registers and stack of a build job read from stdin (in a process without the interpreter)
_RESOURCES = """
import importlib, json, sys
from kvweave.kernels import gpu_build
job = json.load(sys.stdin)
print(json.dumps(gpu_build.resources(gpu_build.build(importlib.import_module(job["module"]), job).asm["cubin"])))
"""


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and cuobjdump)")
def test_a_register_cap_builds_the_pass_in_that_many_registers(tmp_path):
    """``maxnreg``, as the launch passes ``TILES_REGISTERS``, holds the sm_90 build of the decode pass (the words a
    step ahead) to that many registers a thread, where the compiler's own choice takes more."""
    job, _ = recorded_tiles_job(tmp_path)
    job["constants"].update(ASM=True, BYTES=True, WORDS=2)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    used = []
    for cap in (None, 128):
        done = subprocess.run([sys.executable, "-c", _RESOURCES], input=json.dumps({**job, "maxnreg": cap}),
                              capture_output=True, text=True, env=env, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        used.append(json.loads(done.stdout.strip().splitlines()[-1])["registers"])
    assert used[0] > 128 >= used[1]


@pytest.mark.skipif(not _nvidia_backend(), reason="Triton without its CUDA backend cannot compile for a GPU here")
def test_the_byte_permutes_build_for_a_gpu(tmp_path):
    """Built for sm_90 as the launcher passes it on a GPU (``BYTES``, ``ROWS``): the permutes under the exponent byte
    are in the code and no int8 to float16 conversion is left."""
    job, constants = recorded_tiles_job(tmp_path)
    assert constants["ROWS"] is depthweave_decode.TILES_ROWS
    job["constants"].update(ASM=True, BYTES=True)
    built = compile_job(job)
    assert "0x64646464" in built["ptx_text"] and "cvt.rn.f16.s16" not in built["ptx_text"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("switch, off, value", [("TILES_REGISTERS", 0, 144), ("TILES_REGISTERS", 0, 128),
                                                ("TILES_INDEX", False, True), ("TILES_QUERY_LATE", False, True),
                                                ("TILES_L2AHEAD", 0, 4)])
def test_a_register_cap_or_loads_moved_give_the_same_bits_on_the_gpu(tmp_path, monkeypatch, switch, off, value):
    """On the GPU, the decode pass built in ``TILES_REGISTERS`` registers, with its tile index two steps ahead
    (``TILES_INDEX``), with the query's products after the first step's loads (``TILES_QUERY_LATE``) or with its
    coefficients asked of the L2 cache 4 steps ahead (``TILES_L2AHEAD``), writes the bits of the build with that switch
    off."""
    view, query, start, dim = _tiles_case(tmp_path, "dw-kernel")
    run = lambda: fused_decode(view, query, start, dim**-0.5, split=96, variant="tiles")  # noqa: E731
    monkeypatch.setattr(depthweave_decode, switch, off)
    free = run()
    monkeypatch.setattr(depthweave_decode, switch, value)
    assert torch.equal(run(), free)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name, block", [("dw-kernel", 64), ("dw-kernel", 32), ("dw-kernel-blocks", 64),
                                         ("dw-kernel-wide", 64)])
def test_the_byte_permutes_give_the_conversions_bits_on_the_gpu(tmp_path, monkeypatch, name, block):
    """On the GPU: with the byte permutes, the values loaded token-major, both or neither, the pass writes the same
    output bits, and stays within the twin's tolerance."""
    view, query, start, dim = _tiles_case(tmp_path, name)
    outputs = []
    monkeypatch.setattr(depthweave_decode, "TILES_WORDS", 0)  # the byte loads first; the word loads after
    for bytes_, rows in ((False, False), (True, False), (False, True), (True, True)):
        monkeypatch.setattr(depthweave_decode, "TILES_BYTES", bytes_)
        monkeypatch.setattr(depthweave_decode, "TILES_ROWS", rows)
        outputs.append(fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block, variant="tiles"))
    assert torch.equal(outputs[1], outputs[0]) and torch.equal(outputs[3], outputs[2])
    assert (outputs[3] - outputs[0]).abs().max().item() < 1e-5
    for words in (1, 2):  # the codes loaded as words, at the step's start or a step ahead
        monkeypatch.setattr(depthweave_decode, "TILES_WORDS", words)
        worded = fused_decode(view, query, start, dim**-0.5, split=96, block_tokens=block, variant="tiles")
        assert (worded - outputs[3]).abs().max().item() < 1e-5
    assert (outputs[3].float() - torch_decode(view, query, start, dim**-0.5).float()).abs().max().item() < 2e-2
