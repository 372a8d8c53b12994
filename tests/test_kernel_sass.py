"""benchmarks/kernel_sass.py: the lowbit kernels built for sm_90 without a GPU (Triton's own ptxas and nvdisasm), their
machine instructions counted by class and in the token loop."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvweave.kernels.gpu_build import nvdisasm

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_kernel_sass_counts_the_instructions_a_trick_removes():
    """benchmarks/kernel_sass.py builds the lowbit kernel for sm_90 without a GPU (in a process of its own: this one
    runs Triton's interpreter) and counts its machine instructions by class: 'magic' removes integer-to-float
    conversions, so the conversion count falls while the build still holds tensor-core products; a storage a trick
    cannot read is reported as refused."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--storages", "k4v2",
                           "--configs", "wide:,wide:magic,wide:kfold"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split("|")[2].strip(): line.split("|")[3:] for line in done.stdout.splitlines() if line.startswith("| k4v2")}
    plain, magic = rows["`wide:`"], rows["`wide:magic`"]
    assert int(magic[1]) < int(plain[1]) and int(plain[0]) > 500  # conversions; instructions
    assert int(plain[5]) > 0 and int(magic[5]) > 0  # tensor-core products
    assert "refused" in rows["`wide:kfold`"][0]


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_kernel_sass_counts_the_token_loop_and_the_dense_kernel_builds_to_less_per_element():
    """The token loop's count is a part of the whole build; the dense kernel (codes read as 32-bit words) builds to
    fewer loop instructions per key/value element than the wide kernel on the same keys stored after RoPE, the reason
    it is the default there; on keys before RoPE it builds with their rotation, more instructions per element than
    on the same codes stored after RoPE. Its inline assembly (the 2-bit values' byte-permute
    table, the 4-bit uniform values' paired add) assembles for sm_90: ptxas refuses a wrong operand."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--storages", "k4v2,k4v2-post,k4v4e77-post",
                           "--configs", "wide:,dense:"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): [cell.strip() for cell in line.split("|")[3:]]
            for line in done.stdout.splitlines() if line.startswith("| k4v")}
    wide, dense = rows[("k4v2-post", "`wide:`")], rows[("k4v2-post", "`dense:`")]
    rotated = rows[("k4v2", "`dense:`")]
    assert 0 < int(rotated[7]) < int(rotated[0]) and float(rotated[8]) > float(dense[8])
    for row in (wide, dense):
        assert 0 < int(row[7]) < int(row[0])  # the loop within the build
    assert float(dense[8]) < float(wide[8])
    assert int(rows[("k4v4e77-post", "`dense:`")][5]) > 0  # built, with its tensor-core products


_TILE_STORES = """
import importlib, re, sys, attrs, torch
sys.path.insert(0, "benchmarks")
from kvweave.kernels import lowbit_dense
from kvweave.kernels.gpu_build import build, launch_job
from kvweave.kernels.lowbit_decode import plan_launch
from lowbit_kernel import HEAD_DIM, Q_HEADS, packed_view
view = attrs.evolve(packed_view(1, 256, device="cpu", storage="k4v2e48"), inv_freq=None)
for planes in (True, False):
    lowbit_dense.DENSE_KEY_PLANES = planes
    launch = plan_launch(view, torch.randn(1, Q_HEADS, HEAD_DIM), None, HEAD_DIM ** -0.5, variant="dense", lowp=True)
    job = launch_job(launch.kernel, launch.args, launch.constants)
    ttgir = build(importlib.import_module(job["module"]), job).asm["ttgir"]
    tiles = re.findall(r"ttg.local_alloc %\\S+ : \\(tensor<(\\d+x\\d+)xbf16", ttgir)
    print(planes, launch.constants["G"], " ".join(tiles))
lowbit_dense.DENSE_KEY_PLANES = True
for storage in ("k4v2e48t", "k4v4e77t"):
    view = attrs.evolve(packed_view(1, 256, device="cpu", storage=storage), inv_freq=None)
    launch = plan_launch(view, torch.randn(1, Q_HEADS, HEAD_DIM), None, HEAD_DIM ** -0.5, variant="dense", lowp=True)
    job = launch_job(launch.kernel, launch.args, launch.constants)
    ttgir = build(importlib.import_module(job["module"]), job).asm["ttgir"]
    print("tiled", launch.constants["VTILE"], " ".join(re.findall(r"ttg.local_alloc %\\S+ : \\(tensor<(\\d+x\\d+)xbf16", ttgir)))
"""


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_the_dense_kernels_key_tile_reaches_the_tensor_cores_without_shared_memory():
    """Built for sm_90, the dense kernel reading 4-bit keys by code places stores no unpacked [64, 128] key tile in
    shared memory (the words go from shared memory straight into the operand layout); read in channel order, it
    stores one a step. Its query tiles are 8 columns (4 query heads a KV head). With the value codes in tiles of 64
    tokens no [64, 64] value tile goes there either."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", _TILE_STORES], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in done.stdout.splitlines() if line.split()[:1] in (["True"], ["False"])}
    planes, ordered = rows["True"], rows["False"]
    assert planes[0] == ordered[0] == "8"
    assert "64x128" not in planes[1:] and "64x128" in ordered[1:]
    assert "64x64" in planes[1:]  # token-major value codes: their unpacked tiles still go through shared memory
    tiled = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("tiled ")]
    assert len(tiled) == 2  # 2-bit and 4-bit value codes in tiles: neither tile goes through shared memory
    assert all(row[0] == "True" and "64x64" not in row[1:] and "64x128" not in row[1:] for row in tiled)


@pytest.mark.skipif(nvdisasm() is None, reason="needs Triton's CUDA backend (its ptxas and nvdisasm)")
def test_ampere_products_take_the_tiled_values_as_loaded_when_their_operands_are_fenced(tmp_path):
    """Built for sm_80 (Ampere ``mma.sync`` products, as Triton before 3.8 builds the dense kernel for an H200 too),
    the tiled values' operands behind an instruction the compiler does not look past (``ASM`` = 2) reach the products
    without lane shuffles: the loop's shuffles are the softmax's and the bias's (at most 16) and it selects almost
    nothing, for 2- and 4-bit tiles, in fewer instructions than the same build with them visible (``ASM`` = 1, where
    Triton takes the layout of one-byte loads for them and moves every level between lanes)."""
    import json

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    rows = {}
    for asm in (1, 2):
        out = tmp_path / f"asm{asm}.json"
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "kernel_sass.py"), "--storages", "k4v2e48t-post,k4v4e77t-post",
                               "--configs", "dense:", "--arch", "80", "--asm", str(asm), "--out", str(out)],
                              capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-3000:]
        for row in json.loads(out.read_text()):
            ops = row["loop_opcodes"]
            rows[(row["storage"], asm)] = (row["loop"], ops.get("SHFL", 0), ops.get("SEL", 0), ops.get("HMMA", 0))
    for storage in ("k4v2e48t-post", "k4v4e77t-post"):
        fenced, visible = rows[(storage, 2)], rows[(storage, 1)]
        assert fenced[3] > 0 and visible[3] > 0  # Ampere products in both
        assert fenced[1] <= 16 and fenced[2] <= 8, (storage, fenced)
        assert fenced[0] < visible[0], (storage, fenced, visible)


def test_the_token_loop_is_the_longest_innermost_loop_not_a_loop_of_passes_around_it():
    """A pass loop (0x00 .. 0x90) around a long inner loop (0x10 .. 0x70) beside a short one (0x78 .. 0x88): the token
    loop is the long inner one, and a guarded forward branch inside it is listed with its guard (what a count that
    leaves a skipped block out reads)."""
    from kvweave.kernels.gpu_build import branches, token_loop

    code = [(0x00, "MOV", "", ""), (0x10, "HMMA", "", ""), (0x20, "BRA", "@P0", " `(.L_x_2)"), (0x30, "FMNMX", "", ""),
            (0x40, "FADD", "", ""), (0x70, "BRA", "", " `(.L_x_1)"), (0x78, "FADD", "", ""), (0x88, "BRA", "", " `(.L_x_3)"),
            (0x90, "BRA", "", " `(.L_x_0)")]
    labels = {".L_x_0": 0x00, ".L_x_1": 0x10, ".L_x_2": 0x40, ".L_x_3": 0x78}
    assert token_loop(code, labels) == (0x10, 0x70)
    assert (0x20, 0x40, "@P0") in branches(code, labels)
    assert token_loop(code[:1], {}) == (0, -1)
