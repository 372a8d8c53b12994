"""benchmarks/triton_cache_resources.py: the builds in a Triton cache listed with their registers, stack and spills."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import triton
import triton.language as tl

from kvweave.kernels.gpu_build import nvdisasm

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import triton_cache_resources  # noqa: E402

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "triton_cache_resources.py")


@triton.jit
def _scale_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n) * 2.0, mask=offsets < n)


def _build_into(cache: str, maxnreg: int | None) -> None:
    """``_scale_kernel`` built for sm_90 into the Triton cache ``cache`` (a child Python: the cache is read at import)."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import triton\n"
            "from triton.backends.compiler import GPUTarget\nfrom triton.compiler import ASTSource\n"
            "from test_triton_cache_resources import _scale_kernel as k\n"
            "src = ASTSource(k, {'x_ptr': '*fp32', 'n': 'i32', 'BLOCK': 'constexpr'}, constexprs={(2,): 128})\n"
            f"triton.compile(src, target=GPUTarget('cuda', 90, 32), options={{'num_warps': 4, 'maxnreg': {maxnreg}}})\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env={**env, "TRITON_CACHE_DIR": cache}, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.skipif(nvdisasm() is None or nvdisasm("cuobjdump") is None, reason="needs Triton's CUDA backend")
def test_each_cached_build_is_listed_with_its_cap_registers_and_no_spill(tmp_path):
    cache = str(tmp_path / "cache")
    _build_into(cache, None)
    _build_into(cache, 64)
    rows = triton_cache_resources.cached_builds(cache)
    assert [row["kernel"] for row in rows] == ["_scale_kernel", "_scale_kernel"]
    assert [row["maxnreg"] for row in rows] == [None, 64]
    for row in rows:
        assert row["triton"] == triton.__version__ and row["arch"] == 90 and row["warps"] == 4
        assert 0 < row["registers"] <= 64 and row["stack"] == 0 and row["spills"] == row["loop_spills"] == 0
    assert triton_cache_resources.cached_builds(cache, match="_dense") == []
    out = tmp_path / "builds.md"
    done = subprocess.run([sys.executable, SCRIPT, "--cache", cache, "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert out.read_text().count("| _scale_kernel |") == 2 and "| 64 |" in out.read_text()


def test_a_missing_cache_is_named():
    done = subprocess.run([sys.executable, SCRIPT, "--cache", "/nonexistent/triton-cache"], capture_output=True, text=True)
    assert done.returncode != 0
    assert "/nonexistent/triton-cache" in done.stderr or "CUDA backend" in done.stderr
