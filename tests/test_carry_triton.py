"""benchmarks/carry_triton.py without the package index: which wheel members a pack keeps, its parts and their
manifests, and the unpacking on the other side: the package laid out whole, and a missing or altered part refused with
a message that names it."""

from __future__ import annotations

import io
import json
import lzma
import random
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import carry_triton  # noqa: E402


def _tar(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in files.items():
            member = tarfile.TarInfo(name)
            member.size, member.mode = len(data), 0o755
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def test_a_pack_keeps_the_cuda_build_and_leaves_out_the_rest():
    """The NVIDIA backend's sm_90 tools and the package's Python stay; the AMD backend, CUPTI, proton and the ptxas of
    GPUs before sm_90 go (``ptxas-blackwell``, which an H100 builds with, shares that name's start and stays)."""
    keep = ["triton/__init__.py", "triton/_C/libtriton.so", "triton/backends/nvidia/bin/ptxas-blackwell",
            "triton/backends/nvidia/bin/nvdisasm", "triton/backends/nvidia/lib/libdevice.10.bc",
            "triton/backends/nvidia/include/cuda.h", "triton-3.9.0.dist-info/METADATA"]
    drop = ["triton/backends/amd/compiler.py", "triton/backends/nvidia/lib/cupti/libcupti.so",
            "triton/backends/nvidia/lib/cupti-blackwell/libcupti.so", "triton/_C/libproton.so",
            "triton/backends/nvidia/bin/ptxas", "triton/instrumentation/libGPUInstrumentationTestLib.so", "triton/"]
    assert all(carry_triton.kept(name) for name in keep)
    assert not any(carry_triton.kept(name) for name in drop)


def test_a_wheels_kept_members_keep_their_modes(tmp_path):
    """The tar of a wheel holds only the kept members, the tools executable as the wheel had them."""
    wheel = tmp_path / "triton-0.0.0-cp311-abi3-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, mode in (("triton/__init__.py", 0o644), ("triton/backends/nvidia/bin/nvdisasm", 0o755),
                           ("triton/backends/amd/compiler.py", 0o644)):
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            archive.writestr(info, name.encode())
    with tarfile.open(fileobj=io.BytesIO(carry_triton.tar_of_wheel(wheel))) as tar:
        members = {m.name: m.mode for m in tar.getmembers()}
    assert members == {"triton/__init__.py": 0o644, "triton/backends/nvidia/bin/nvdisasm": 0o755}


def test_parts_unpack_to_the_package_and_an_env_file(tmp_path):
    """Cut into 1 MB parts (an earlier pack's extra part removed), the parts join to the package under the target,
    with an env file that puts it first on PYTHONPATH and finds its backends in its tree."""
    files = {"triton/__init__.py": b"__version__ = '9.9.9'\n", "triton/_C/lib.so": random.Random(0).randbytes(1_500_000)}
    tar = _tar(files)
    packed = lzma.compress(tar, preset=0)
    stale = tmp_path / "wheels" / "triton-9.9.9-7"
    stale.mkdir(parents=True)
    folders = carry_triton.write_parts(packed, len(tar), "9.9.9", "3.12", 1, tmp_path / "wheels")
    assert not stale.exists()
    manifests = [json.loads((f / "manifest.json").read_text()) for f in folders]
    assert len(folders) == 2 and [m["part"] for m in manifests] == [1, 2] and {m["parts"] for m in manifests} == {2}
    assert sum((f / "part").stat().st_size for f in folders) == len(packed)
    target = carry_triton.unpack(str(tmp_path / "wheels" / "triton-9.9.9-*"), tmp_path / "site")
    assert {str(p.relative_to(target)) for p in target.rglob("*") if p.is_file()} == set(files) | {"env.sh"}
    assert (target / "triton/_C/lib.so").read_bytes() == files["triton/_C/lib.so"]
    env = (target / "env.sh").read_text()
    assert f"PYTHONPATH={target.resolve()}" in env and "TRITON_BACKENDS_IN_TREE=1" in env
    done = subprocess.run(["bash", "-c", f"source {target / 'env.sh'} && python -c 'import triton; print(triton.__version__)'"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.stdout.strip() == "9.9.9", done.stderr


def test_a_missing_or_altered_part_is_refused(tmp_path):
    """A part not carried: the message names the parts found; a part altered in transit: the digest does not match.
    Nothing is unpacked either way."""
    packed = lzma.compress(_tar({"triton/x.py": random.Random(1).randbytes(1_500_000)}), preset=0)
    folders = carry_triton.write_parts(packed, 0, "9.9.9", "3.12", 1, tmp_path / "wheels")
    assert len(folders) == 2
    whole = (folders[1] / "part").read_bytes()
    (folders[1] / "part").rename(tmp_path / "aside")
    (folders[1] / "manifest.json").rename(tmp_path / "aside.json")
    with pytest.raises(SystemExit, match=r"has \d+ part\(s\); found \[1"):
        carry_triton.unpack(str(tmp_path / "wheels" / "triton-9.9.9-*"), tmp_path / "site")
    (tmp_path / "aside.json").rename(folders[1] / "manifest.json")
    (folders[1] / "part").write_bytes(whole[:-1] + bytes([whole[-1] ^ 1]))
    with pytest.raises(SystemExit, match="do not match their digest"):
        carry_triton.unpack(str(tmp_path / "wheels" / "triton-9.9.9-*"), tmp_path / "site")
    assert not (tmp_path / "site").exists()
    with pytest.raises(SystemExit, match="no parts match"):
        carry_triton.unpack(str(tmp_path / "nowhere-*"), tmp_path / "site")
    with pytest.raises(SystemExit, match="--part-mb must be at least 1"):
        carry_triton.write_parts(packed, 0, "9.9.9", "3.12", 0, tmp_path / "wheels")
