"""The ``tiles`` pass's register cap (``KVWEAVE_TILES_REGISTERS``, kernels/depthweave_decode.py ``TILES_REGISTERS``):
read from the environment, refused by name when it is not a cap the pass was built at, held by the sm_90 build without
a spill at 160 (12 one-warp programs an SM, what the one-wave split rule counts on), 160 unset with a Triton after 3.6,
and the same output bits on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvweave.kernels import depthweave_decode
from kvweave.kernels.depthweave_decode import fused_decode
from kvweave.kernels.gpu_build import nvdisasm

from env_settings import check_env_setting
from test_tiles_bytes import _RESOURCES
from test_tiles_pass import _tiles_case, recorded_tiles_job


def test_the_cap_is_read_from_the_environment_and_a_wrong_value_refused():
    check_env_setting("KVWEAVE_TILES_REGISTERS",
                      "from kvweave.kernels import depthweave_decode; print(depthweave_decode.TILES_REGISTERS)",
                      {"0": "0", "160": "160", "168": "168"}, refused="150")


@pytest.mark.parametrize("version, setting, cap", [("3.6.0", None, None), ("3.9.0", None, 160), ("3.10.1", None, 160),
                                                   ("3.9.0", 0, None), ("3.6.0", 144, 144), ("3.9.0", 168, 168)])
def test_unset_the_cap_is_160_for_a_triton_after_3_6_and_a_setting_wins(monkeypatch, version, setting, cap):
    """Triton 3.9 builds the pass in more registers than 12 one-warp programs an SM leave (Triton 3.6 in 168); unset,
    the launch caps it at 160 there and leaves 3.6 its own choice; 0 is the compiler's choice, another value that cap."""
    import triton

    monkeypatch.setattr(triton, "__version__", version)
    monkeypatch.setattr(depthweave_decode, "TILES_REGISTERS", setting)
    assert depthweave_decode.tiles_register_cap() == cap


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and cuobjdump)")
def test_at_160_registers_the_decode_pass_builds_without_a_spill(tmp_path):
    """The decode pass as a GPU launches it (words a step ahead), capped at 160 registers: at most 160 a thread and no
    stack (nothing spilled to local memory), whatever the installed Triton's own choice would be."""
    job, _ = recorded_tiles_job(tmp_path)
    job["constants"].update(ASM=True, BYTES=True, WORDS=2)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _RESOURCES], input=json.dumps({**job, "maxnreg": 160}),
                          capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    used = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0 < used["registers"] <= 160 and used["stack"] == 0, used


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("cap", [160, 168])
def test_the_capped_pass_writes_the_bits_of_the_compilers_choice_on_the_gpu(tmp_path, monkeypatch, cap):
    view, query, start, dim = _tiles_case(tmp_path, "dw-kernel")
    run = lambda: fused_decode(view, query, start, dim**-0.5, split=96, variant="tiles")  # noqa: E731
    monkeypatch.setattr(depthweave_decode, "TILES_REGISTERS", 0)
    free = run()
    monkeypatch.setattr(depthweave_decode, "TILES_REGISTERS", cap)
    assert torch.equal(run(), free)
