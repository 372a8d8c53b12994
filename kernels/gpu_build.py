"""A Triton kernel built for an NVIDIA GPU without one: the launch's argument types and constants compiled for a
target architecture (Triton carries its own ptxas), and the machine code's instructions counted (its nvdisasm). What
the tests use to check that a kernel the interpreter accepts also builds for the GPU, and what
``benchmarks/kernel_sass.py`` counts."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile
from typing import Any

#: Triton's names of the tensor element types a launch passes
TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "uint8": "u8", "int8": "i8", "int16": "i16",
                "int32": "i32", "int64": "i64"}


def launch_job(kernel: Any, args: tuple, constants: dict) -> dict:
    """What building ``kernel[grid](*args, **constants)`` needs, as plain data: the kernel's name and module, the
    arguments' Triton types, the constants (``num_warps``, ``maxnreg``, ``enable_fp_fusion``, ``num_stages`` and ``launch_pdl`` apart), as a GPU build takes them: the hardware
    cos/sin (``APPROX``) and inline assembly (``ASM``) wherever the tile operands are the GPU's (``LOWP``), whatever the
    process planning it runs in; and, as a
    launch specializes them, which arguments are multiples of 16 (pointers by their address, integers by their value)."""
    types, aligned = [], []
    for index, arg in enumerate(args):
        if hasattr(arg, "dtype") and hasattr(arg, "data_ptr"):
            types.append("*" + TRITON_TYPES[str(arg.dtype).replace("torch.", "")])
            if arg.data_ptr() % 16 == 0:
                aligned.append(index)
        else:
            types.append("fp32" if isinstance(arg, float) else "i32")
            if isinstance(arg, int) and not isinstance(arg, bool) and arg % 16 == 0:
                aligned.append(index)
    constants = dict(constants)
    warps = constants.pop("num_warps", 4)
    registers = constants.pop("maxnreg", None)
    fusion = constants.pop("enable_fp_fusion", True)
    stages = constants.pop("num_stages", None)
    pdl = constants.pop("launch_pdl", False)
    for name in ("APPROX", "ASM"):  # the GPU's arithmetic wherever the operands are bfloat16 (an ASM of 2 kept)
        if name in constants:
            constants[name] = (constants[name] or True) if constants.get("LOWP") else False
    fn = getattr(kernel, "fn", kernel)
    return {"kernel": fn.__name__, "module": fn.__module__, "types": types, "constants": constants, "num_warps": warps,
            "maxnreg": registers, "aligned": aligned, "enable_fp_fusion": fusion, "num_stages": stages,
            "launch_pdl": pdl}


def build(module: Any, job: dict, arch: int = 90) -> Any:
    """The compiled kernel ``job["kernel"]`` of ``module`` for ``sm_{arch}`` (Triton's CompiledKernel)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(module, job["kernel"])
    signature = dict(zip(fn.arg_names, job["types"]))
    signature.update({name: "constexpr" for name in job["constants"]})
    constexprs = {(fn.arg_names.index(name),): value for name, value in job["constants"].items()}
    attrs = {(index,): [["tt.divisibility", 16]] for index in job.get("aligned", [])}
    return triton.compile(ASTSource(fn, signature, constexprs=constexprs, attrs=attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": job["num_warps"], "maxnreg": job.get("maxnreg"),
                                   "enable_fp_fusion": job.get("enable_fp_fusion", True),
                                   **({"launch_pdl": True} if job.get("launch_pdl") else {}),
                                   **({"num_stages": job["num_stages"]} if job.get("num_stages") else {})})


def nvdisasm(name: str = "nvdisasm") -> str | None:
    """The path of the nvdisasm (or another ``name`` among its tools, e.g. cuobjdump) that Triton's CUDA backend
    carries, or None (no Triton, or no CUDA backend)."""
    try:
        import triton
    except ImportError:
        return None
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return tool if os.path.exists(tool) else None


def _read_cubin(name: str, flag: str, cubin: bytes) -> str:
    """What Triton's own tool ``name`` prints for ``cubin`` with ``flag``."""
    tool = nvdisasm(name)
    if tool is None:
        raise RuntimeError(f"no {name} beside Triton: it comes with Triton's CUDA backend")
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        return subprocess.run([tool, flag, path], capture_output=True, text=True, check=True).stdout


def resources(cubin: bytes) -> dict:
    """The registers a thread and the stack bytes of ``cubin``'s kernel, as Triton's own cuobjdump reports them."""
    text = _read_cubin("cuobjdump", "-res-usage", cubin)
    found = {key: int(value) for key, value in re.findall(r"\b(REG|STACK):(\d+)", text)}
    return {"registers": found.get("REG", 0), "stack": found.get("STACK", 0)}


def sass_listing(cubin: bytes) -> tuple[list[tuple[int, str, str, str]], dict[str, int]]:
    """``cubin``'s machine code as Triton's own nvdisasm prints it: (address, opcode, guard predicate or "", the rest)
    per instruction, and each branch label's address."""
    text = _read_cubin("nvdisasm", "-c", cubin)
    code, labels, pending = [], {}, []
    for line in text.splitlines():
        label = re.match(r"^(\.L_x_\d+):", line)
        if label:
            pending.append(label.group(1))
            continue
        match = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*)(.*)", line)
        if match:
            address = int(match.group(1), 16)
            labels.update({name: address for name in pending})
            pending = []
            code.append((address, match.group(3), (match.group(2) or "").strip(), match.group(4)))
    return code, labels


def branches(code: list[tuple[int, str, str, str]], labels: dict[str, int]) -> list[tuple[int, int, str]]:
    """Each branch of :func:`sass_listing`'s ``code`` to a known label: (its address, the target's, its guard)."""
    return [(address, labels[target.group(1)], guard) for address, op, guard, rest in code if op == "BRA"
            for target in [re.search(r"(\.L_x_\d+)", rest)] if target and target.group(1) in labels]


def token_loop(code: list[tuple[int, str, str, str]], labels: dict[str, int]) -> tuple[int, int]:
    """The address span of the longest innermost loop (from the target of a backward branch to that branch, holding no
    other such span: a kernel's token loop, not a loop of passes around it); (0, -1) where there is none."""
    spans = [(to, at) for at, to, _ in branches(code, labels) if to < at]
    inner = [span for span in spans if not any(o != span and span[0] <= o[0] and o[1] <= span[1] for o in spans)]
    return max(inner, key=lambda span: span[1] - span[0]) if inner else (0, -1)


def sass_opcodes(cubin: bytes, loop: bool = False) -> collections.Counter:
    """How many times each opcode (predicates and modifiers dropped) appears in ``cubin``'s machine code, as
    Triton's own nvdisasm prints it; ``loop``: only in the token loop (:func:`token_loop`), each instruction once, a
    branch skipped at run time included."""
    code, labels = sass_listing(cubin)
    lo, hi = token_loop(code, labels) if loop else (0, float("inf"))
    return collections.Counter(op for address, op, _, _ in code if lo <= address <= hi)
