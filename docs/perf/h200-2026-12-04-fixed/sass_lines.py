"""Where the dense kernel's sm_90 token loop spends its instructions: each instruction of the loop counted against the
Triton function whose source line it comes from (Triton's line information, read by Triton's own nvdisasm). Built on a
CPU; with the GPU machine's Triton for its counts:

    PYTHONPATH=/path/to/triton-3.6 python docs/perf/h200-2026-12-04-fixed/sass_lines.py k4v2e48t k4v4e77t

Prints, per storage, the loop's instructions by function (file:function), largest first, and the source lines of the
five largest."""
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sass_fixed import dense_cubin  # noqa: E402

from kvweave.kernels.gpu_build import nvdisasm, sass_listing, token_loop  # noqa: E402


def functions(path):
    """(first line, last line, name) of each function defined in ``path``."""
    tree = ast.parse(open(path).read())
    return [(node.lineno, node.end_lineno, node.name) for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)]


def enclosing(spans, line):
    """The innermost function of ``spans`` holding ``line``, or "?"."""
    found = [(hi - lo, name) for lo, hi, name in spans if lo <= line <= hi]
    return min(found)[1] if found else "?"


for storage in sys.argv[1:]:
    cubin = dense_cubin(storage)
    code, labels = sass_listing(cubin)
    lo, hi = token_loop(code, labels)
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "kernel.cubin")
        with open(path, "wb") as handle:
            handle.write(cubin)
        text = subprocess.run([nvdisasm(), "-c", "-gi", path], capture_output=True, text=True, check=True).stdout
    where, by_line, spans = None, collections.Counter(), {}
    for line in text.splitlines():
        source = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if source:
            where = (source.group(1), int(source.group(2)))
            continue
        match = re.match(r"\s*/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?[A-Z]", line)
        if match and lo <= int(match.group(1), 16) <= hi:
            by_line[where] += 1
    by_function = collections.Counter()
    for (file, number), count in by_line.items():
        if file not in spans:
            spans[file] = functions(file) if os.path.exists(file) else []
        by_function[f"{os.path.basename(file)}:{enclosing(spans[file], number)}"] += count
    print(f"{storage}: {sum(by_line.values())} instructions in the token loop (a first-step block included)")
    for name, count in by_function.most_common():
        print(f"  {count:4d}  {name}")
    for (file, number), count in by_line.most_common(5):
        print(f"  line {os.path.basename(file)}:{number} ({count}): {open(file).readlines()[number - 1].strip()[:90]}")
