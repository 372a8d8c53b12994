"""kvweave's Triton kernels (``kvweave.kernels``).

Where Python runs with the checkout's root on its import path (``python -m ...`` or ``python -c`` started there), this
folder is also found as the top-level ``kernels``, the name of the Hugging Face package that transformers (5.25 and
later) imports when it is installed. Imported under that name, it hands the import to the installed package."""

if __name__ == "kernels":  # pragma: no cover - only where the checkout's root is on sys.path
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [entry for entry in sys.path if os.path.abspath(entry or os.curdir) != _root])
    if _spec is not None and _spec.loader is not None:  # the installed package takes the name (the import system
        _module = importlib.util.module_from_spec(_spec)  # returns what sys.modules holds once this file has run)
        sys.modules["kernels"] = _module
        _spec.loader.exec_module(_module)
