"""A Triton release packed small enough to travel to the GPU machine in a few calls, and unpacked there.

    python benchmarks/carry_triton.py pack [--version 3.9.0] [--python 3.12] [--part-mb 29] [--out wheels]
    python benchmarks/carry_triton.py unpack [--parts 'wheels/triton-3.9.0-*'] [--target results/triton-3.9.0]

The GPU machine has no network and its Triton is the one its torch installed (3.6 with torch 2.11), while a fresh
install takes Triton 3.9 (kvweave asks for ``triton>=3.0``), which builds the kernels differently (docs/kernels.md "What Triton
3.9 builds"). A Triton wheel is about 286 MB; a call carries at most 64 MiB with the working tree. ``pack`` (here,
with the package index) downloads the wheel for the GPU machine's Python, keeps what a CUDA build on an H100/H200
needs (the Python package, ``libtriton.so`` without its debugging symbols, the NVIDIA backend's tools, headers and
libdevice; not the AMD backend, CUPTI, proton, the test libraries or the ptxas of GPUs before sm_90), compresses it as
xz and cuts it into parts of ``--part-mb`` MB, each in its own ignored folder ``OUT/triton-VERSION-N/`` with a
manifest (Triton 3.9.0 for Python 3.11: 268 MB trimmed, 57.6 MB as xz, two parts; 2.5 minutes on two cores). Carry one part a call, in
calls that follow each other while the machine stays warm (what an earlier call carried stays there); the last call
runs ``unpack``, which checks the joined parts against the manifest's digest, lays the package out under ``--target``
and writes ``TARGET/env.sh``, which puts it first on ``PYTHONPATH`` and has Triton find its backends in its own tree
(``TRITON_BACKENDS_IN_TREE=1``: the installed Triton's entry points name the AMD backend, which the pack leaves out)::

    run carry=[wheels/triton-3.9.0-1]  command: true
    run carry=[wheels/triton-3.9.0-2]  command: python benchmarks/carry_triton.py unpack && \\
        source results/triton-3.9.0/env.sh && python benchmarks/lowbit_kernel.py ...
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import io
import json
import lzma
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

#: what a CUDA build does not need, as path prefixes inside the wheel
LEFT_OUT = ("triton/backends/amd/", "triton/backends/nvidia/lib/cupti", "triton/_C/libproton", "triton/instrumentation/",
            "triton/FileCheck")
#: left out by their exact names: the ptxas Triton 3.9 takes for GPUs before sm_90 only (an H100 or H200 builds with
#: ptxas-blackwell)
LEFT_OUT_FILES = ("triton/backends/nvidia/bin/ptxas",)
#: the shared library stripped of its debugging symbols (500 MB -> about 190 MB for Triton 3.9)
STRIPPED = ("triton/_C/libtriton.so",)


def kept(name: str) -> bool:
    """Whether the wheel's member ``name`` goes into the pack."""
    return not name.endswith("/") and not name.startswith(LEFT_OUT) and name not in LEFT_OUT_FILES


def download(version: str, python: str, folder: Path) -> Path:
    """The manylinux x86-64 wheel of Triton ``version`` for CPython ``python`` (e.g. "3.12"), downloaded into
    ``folder``."""
    subprocess.run([sys.executable, "-m", "pip", "download", f"triton=={version}", "--no-deps", "--only-binary=:all:",
                    "--python-version", python, "--platform", "manylinux_2_28_x86_64", "-d", str(folder), "-q"], check=True)
    wheels = sorted(folder.glob(f"triton-{version}-*.whl"))
    if not wheels:
        raise SystemExit(f"carry_triton.py: pip downloaded no Triton {version} wheel for Python {python} into {folder}")
    return wheels[0]


def stripped(data: bytes, name: str) -> bytes:
    """``data`` (a shared library) without its debugging symbols, by the system's ``strip``; unchanged where there is
    none."""
    if shutil.which("strip") is None:
        print(f"carry_triton.py: no strip on this machine; {name} kept whole", file=sys.stderr)
        return data
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lib.so"
        path.write_bytes(data)
        subprocess.run(["strip", "--strip-unneeded", str(path)], check=True)
        return path.read_bytes()


def tar_of_wheel(wheel: Path) -> bytes:
    """The kept members of ``wheel`` as an uncompressed tar (modes kept: the tools must stay executable)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(wheel) as archive, tarfile.open(fileobj=buffer, mode="w") as tar:
        for info in archive.infolist():
            if not kept(info.filename):
                continue
            data = archive.read(info)
            if info.filename in STRIPPED:
                data = stripped(data, info.filename)
            member = tarfile.TarInfo(info.filename)
            member.size = len(data)
            member.mode = (info.external_attr >> 16) & 0o777 or 0o644
            tar.addfile(member, io.BytesIO(data))
    return buffer.getvalue()


def pack(version: str, python: str, part_mb: int, out: Path) -> list[Path]:
    """Download, trim, compress and cut Triton ``version`` for ``python`` into parts under ``out``; the part folders."""
    with tempfile.TemporaryDirectory() as tmp:
        wheel = download(version, python, Path(tmp))
        print(f"downloaded {wheel.name} ({wheel.stat().st_size / 1e6:.1f} MB); trimming and compressing (a few minutes)",
              file=sys.stderr)
        tar = tar_of_wheel(wheel)
    packed = lzma.compress(tar, preset=6)
    folders = write_parts(packed, len(tar), version, python, part_mb, out)
    print(f"Triton {version} for Python {python}: {len(tar) / 1e6:.1f} MB trimmed, {len(packed) / 1e6:.1f} MB as xz, "
          f"{len(folders)} part(s) of at most {part_mb} MB:", file=sys.stderr)
    for folder in folders:
        print(folder)
    return folders


def write_parts(packed: bytes, tar_bytes: int, version: str, python: str, part_mb: int, out: Path) -> list[Path]:
    """``packed`` (the xz of a tar of ``tar_bytes``) cut into parts of ``part_mb`` MB, each in a folder
    ``out/triton-VERSION-N`` with a manifest (the whole's digest, the part's number and the count); an earlier pack's
    parts of the same version are removed first."""
    if part_mb < 1:
        raise SystemExit(f"carry_triton.py: --part-mb must be at least 1, got {part_mb}")
    digest = hashlib.sha256(packed).hexdigest()
    size = part_mb * 1_000_000
    chunks = [packed[i:i + size] for i in range(0, len(packed), size)]
    for stale in out.glob(f"triton-{version}-*"):
        shutil.rmtree(stale)
    folders = []
    for index, chunk in enumerate(chunks, start=1):
        folder = out / f"triton-{version}-{index}"
        folder.mkdir(parents=True)
        (folder / "part").write_bytes(chunk)
        manifest = {"version": version, "python": python, "part": index, "parts": len(chunks), "sha256": digest,
                    "bytes": len(packed), "tar_bytes": tar_bytes}
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
        folders.append(folder)
    return folders


def unpack(pattern: str, target: Path) -> Path:
    """Join the parts matching ``pattern`` (folders with ``part`` and ``manifest.json``), check them against the
    manifest, and extract the package under ``target``; returns ``target``."""
    parts = [(json.loads((Path(f) / "manifest.json").read_text()), Path(f)) for f in sorted(glob.glob(pattern))
             if (Path(f) / "manifest.json").exists()]
    if not parts:
        raise SystemExit(f"carry_triton.py: no parts match {pattern!r} (each a folder with part and manifest.json)")
    first = parts[0][0]
    parts = sorted((m["part"], f) for m, f in parts if m["sha256"] == first["sha256"])
    if [n for n, _ in parts] != list(range(1, first["parts"] + 1)):
        raise SystemExit(f"carry_triton.py: Triton {first['version']} has {first['parts']} part(s); found "
                         f"{[n for n, _ in parts]} under {pattern!r} (a part not carried yet, or the machine was handed "
                         f"back between the calls)")
    packed = b"".join((f / "part").read_bytes() for _, f in parts)
    if hashlib.sha256(packed).hexdigest() != first["sha256"]:
        raise SystemExit(f"carry_triton.py: the joined parts of Triton {first['version']} do not match their digest")
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(packed)), mode="r") as tar:
        tar.extractall(target, filter="tar")
    # its backends found in the tree (the installed Triton's entry points name backends this one left out)
    (target / "env.sh").write_text(f"export PYTHONPATH={target.resolve()}${{PYTHONPATH:+:$PYTHONPATH}}\n"
                                   "export TRITON_BACKENDS_IN_TREE=1\n")
    print(f"Triton {first['version']} unpacked under {target}: source {target / 'env.sh'} to use it", file=sys.stderr)
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack", help="download, trim, compress and cut a Triton wheel into parts (needs the package index)")
    p.add_argument("--version", default="3.9.0")
    p.add_argument("--python", default="3.12", help="the GPU machine's Python")
    p.add_argument("--part-mb", type=int, default=29, help="MB a part (a call carries 64 MiB with the working tree)")
    p.add_argument("--out", default="wheels", help="folder for the part folders (ignored by git)")
    u = sub.add_parser("unpack", help="join the carried parts and lay out the package")
    u.add_argument("--parts", default="wheels/triton-3.9.0-*")
    u.add_argument("--target", default="results/triton-3.9.0")
    args = parser.parse_args()
    if args.command == "pack":
        pack(args.version, args.python, args.part_mb, Path(args.out))
    else:
        unpack(args.parts, Path(args.target))


if __name__ == "__main__":
    main()
