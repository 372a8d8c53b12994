"""Triton's interpreter (``TRITON_INTERPRET=1``, conftest.py on a CPU) patches ``triton.language`` to its own builtins
when a kernel launch starts, restores it when the launch ends, and patches it again at every call of a ``@triton.jit``
device function inside the launch. Those inner patchings change nothing (the builtins are patched already and the
other attributes are set to equal replacements), yet each lists the members of four modules: about half the time of
the kernels here that call device functions in their token loop. :func:`patch_the_language_once_a_launch` makes a device
function's call skip the patching where the running launch has patched every language module its function sees; a
module it does not see is patched as before. The kernels run the same interpreted code on the same builtins."""

from __future__ import annotations

import inspect


def patch_the_language_once_a_launch() -> bool:
    """Install the skip in ``triton.runtime.interpreter`` (idempotent); False where this Triton's interpreter is not
    laid out as expected (then nothing is changed)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    real = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if real is None or scope_type is None or not hasattr(interpreter, "GridExecutor"):
        return False
    if getattr(real, "once_a_launch", False):
        return True
    languages = (tl, tl.core)
    patched: list[set[int]] = []  # per launch running (at most one): the ids of the language modules it patched

    seen_by: dict = {}  # per function: the ids of the language modules among its globals (read once)

    def visible(fn) -> set[int]:
        if fn not in seen_by:
            seen_by[fn] = {id(value) for value in fn.__globals__.values() if inspect.ismodule(value) and value in languages}
        return seen_by[fn]

    class LaunchScope:
        """A launch's patch scope: restoring it also ends the launch."""

        def __init__(self, scope, seen: set[int]) -> None:
            self.scope, self.seen = scope, seen

        def restore(self) -> None:
            patched.remove(self.seen)
            self.scope.restore()

    def patch_lang(fn):
        seen = visible(fn)
        if patched and seen and seen <= patched[-1]:  # a device function's call within a launch: patched already
            return scope_type()
        if patched:  # a device function seeing a module the launch did not patch (or none: the interpreter's error)
            scope = real(fn)
            patched[-1] |= seen
            return scope
        scope = real(fn)
        patched.append(set(seen))  # a copy: a device function's modules are added to it
        return LaunchScope(scope, patched[-1])

    patch_lang.once_a_launch = True
    patch_lang.real = real  # the interpreter's own (tests/test_interpreter_launches.py runs a kernel with both)
    interpreter._patch_lang = patch_lang
    return True
