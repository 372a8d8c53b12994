"""``kvweave eval``: the papers' measurements for any pipeline and model, resumable, in a results folder.

Tasks (each a subcommand; ``table`` runs several and assembles them):

* ``needle``: needle in a haystack over context lengths x depths x distinct needles; greedy answers,
  a hit when the expected value occurs in the answer; a heatmap per pipeline.
* ``qa``: extractive QA (HotpotQA distractor setting, SQuAD v2 answerable questions) over long contexts
  padded with distractor paragraphs; exact match and F1 as those datasets define them.
* ``ppl``: perplexity of essay text fed in chunks (the cache compresses as it fills), against a
  DynamicCache fed identically.
* ``fidelity``: Eq. (3) attention-output relative error per layer and overall (see
  :func:`kvweave.tools.metrics.attention_output_error`).
* ``speed``: time to first token, decode tokens/s, stored bytes and (on CUDA) peak memory of one
  generation from a prompt of ``--speed-tokens`` tokens.

A run folder holds ``settings.json`` (the settings, and per session the command, date, git commit,
package versions and device), ``cells.jsonl`` (one line per finished cell, written as it finishes) and
the outputs (drawn and tabulated by :mod:`kvweave.tools.eval_report`). Rerunning the same command resumes: finished cells are read back, the rest are run. A
folder written with other settings is refused (``--fresh`` discards it); adding pipelines to a folder is
allowed, since every cell is keyed by its pipeline.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import attrs
import torch

from kvweave.tools import datasets
from kvweave.tools import metrics
from kvweave.tools import scoring
from kvweave.tools.data import essays_text, leading_token_ids
from kvweave.tools.eval_report import fidelity_plot, needle_heatmap, write_table
from kvweave.core.errors import KvweaveError
from kvweave.engine.generation import generate
from kvweave.engine.pipeline import build_cache
from kvweave.core.registry import Registry, ResolvedPipeline, load_registry

TASKS = ("needle", "qa", "ppl", "fidelity", "speed")
PPL_OFFSET = 2_600_000  # characters into the essays: text the needle haystacks never use


class EvalError(KvweaveError):
    """A bad evaluation setting or run folder."""


# ------------------------------------------------------------------------------------- run folder
def environment(device: str) -> dict[str, Any]:
    """Versions, git commit and device of this process (recorded per session in settings.json)."""
    import transformers

    versions = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("kvweave", "triton", "numpy"):
        try:
            from importlib.metadata import version

            versions[name] = version(name)
        except Exception:  # noqa: BLE001 - an absent optional package is simply not listed
            pass
    commit, dirty = _git_state(Path(__file__).resolve().parents[1])
    if device.startswith("cuda") and torch.cuda.is_available():
        hardware = torch.cuda.get_device_name(torch.device(device))
    else:
        hardware = f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores"
    return {"versions": versions, "git_commit": commit or None, "git_dirty": dirty, "device": device, "hardware": hardware,
            "platform": platform.platform()}


def _git_state(source: Path) -> tuple[str, bool]:
    """The commit and dirtiness of the git checkout kvweave runs from; ("", False) when it does not run
    from its own checkout (an installed wheel, or a copy inside another repository)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(source), *args], capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        top = git("rev-parse", "--show-toplevel")
        if not top or Path(top).resolve() != source:
            return "", False
        return git("rev-parse", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "", False


class RunFolder:
    """``settings.json`` + ``cells.jsonl`` of one evaluation run, resumable."""

    def __init__(self, path: Path, settings: dict[str, Any], pipelines: list[str], command: str, device: str, fresh: bool = False) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.settings_file = self.path / "settings.json"
        self.cells_file = self.path / "cells.jsonl"
        record: dict[str, Any] = {"settings": settings, "pipelines": [], "sessions": []}
        if self.settings_file.exists() and not fresh:
            try:
                old = json.loads(self.settings_file.read_text(encoding="utf-8"))
            except json.JSONDecodeError as exc:
                raise EvalError(f"{self.settings_file} is not valid JSON ({exc}); use --fresh to start this folder anew") from exc
            if old.get("settings") != settings:
                keys = sorted(set(old.get("settings", {})) | set(settings))
                changed = [f"{k}: {old.get('settings', {}).get(k)!r} -> {settings.get(k)!r}" for k in keys
                           if old.get("settings", {}).get(k) != settings.get(k)]
                raise EvalError(
                    f"{self.path} holds a run with other settings ({'; '.join(changed)}); run the same command to resume it, "
                    "choose another --out, or pass --fresh to discard it"
                )
            record = old
            record["settings"] = settings
        elif fresh and self.cells_file.exists():
            self.cells_file.unlink()
        record["pipelines"] = list(dict.fromkeys([*record.get("pipelines", []), *pipelines]))
        when = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        record["sessions"].append({"started": when, "command": command, **environment(device)})
        self.session = len(record["sessions"]) - 1
        self._write_settings(record)
        self.settings = settings
        self.record = record
        self.cells = self._read()

    @classmethod
    def existing(cls, path: Path) -> RunFolder:
        """An existing run folder, read only (for ``kvweave eval report``)."""
        self = cls.__new__(cls)
        self.path = Path(path)
        self.settings_file = self.path / "settings.json"
        self.cells_file = self.path / "cells.jsonl"
        if not self.settings_file.is_file():
            raise EvalError(f"{self.path} is not a kvweave eval results folder (no settings.json)")
        try:
            self.record = json.loads(self.settings_file.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise EvalError(f"{self.settings_file} is not valid JSON ({exc})") from exc
        self.settings = self.record["settings"]
        self.session = len(self.record["sessions"]) - 1
        self.cells = self._read()
        return self

    def _write_settings(self, record: dict[str, Any]) -> None:
        temp = self.settings_file.with_suffix(".json.partial")
        temp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        os.replace(temp, self.settings_file)

    def _read(self) -> dict[str, dict[str, Any]]:
        cells: dict[str, dict[str, Any]] = {}
        if not self.cells_file.exists():
            return cells
        for line in self.cells_file.read_text(encoding="utf-8").splitlines():
            try:
                item = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by an interruption: that cell runs again
            cells[item["key"]] = item
        return cells

    def get(self, key: str) -> dict[str, Any] | None:
        return self.cells.get(key)

    def add(self, key: str, record: dict[str, Any]) -> dict[str, Any]:
        item = {"key": key, "session": self.session, **record}
        with self.cells_file.open("a", encoding="utf-8") as file:
            file.write(json.dumps(item) + "\n")
            file.flush()
            os.fsync(file.fileno())
        self.cells[key] = item
        return item

    def records(self, task: str, name: str) -> list[dict[str, Any]]:
        """Every finished cell of ``task`` for pipeline ``name``."""
        prefix = key(task, name) + "|"
        return [item for k, item in self.cells.items() if k.startswith(prefix)]

    def write_json(self, name: str, data: Any) -> Path:
        path = self.path / name
        path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")
        return path


def key(*parts: Any) -> str:
    return "|".join(str(p) for p in parts)


# ----------------------------------------------------------------------------------------- context
class Evaluation:
    """A model, its tokenizer, the pipelines and the run folder a task works with."""

    def __init__(self, model: Any, tokenizer: Any, registry: Registry, pipelines: list[str], run: RunFolder,
                 seed: int = 0, max_new_tokens: int = 24, chat: bool = True, progress: bool = True) -> None:
        self.model, self.tokenizer, self.registry, self.run = model, tokenizer, registry, run
        self.pipelines = pipelines
        self.seed = seed
        self.max_new_tokens = max_new_tokens
        self.chat = chat and bool(getattr(tokenizer, "chat_template", None))
        self.progress = progress
        self.errors: dict[str, str] = {}
        self._resolved: dict[str, ResolvedPipeline] = {}

    @property
    def device(self) -> torch.device:
        return self.model.device

    def pipeline(self, name: str) -> ResolvedPipeline | None:
        """The resolved pipeline, or None (its error noted) when it cannot be built for this model."""
        if name in self.errors:
            return None
        if name not in self._resolved:
            try:
                pipeline = self.registry.resolve(name)
                build_cache(pipeline, self.model, tokenizer=self.tokenizer)  # fails here on this model, or not at all
            except KvweaveError as exc:
                self.errors[name] = str(exc)
                self.say(f"{name}: skipped: {exc}")
                return None
            self._resolved[name] = pipeline
        return self._resolved[name]

    def cache(self, name: str) -> Any:
        return build_cache(self._resolved[name], self.model, tokenizer=self.tokenizer)

    def say(self, message: str) -> None:
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(message, file=sys.stderr)

    def bar(self, total: int, done: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=done, desc=desc, unit="cell", file=sys.stderr, disable=not self.progress, dynamic_ncols=True)

    def encode_prompt(self, text: str) -> dict[str, torch.Tensor]:
        if self.chat:
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=not self.chat, return_tensors="pt")

    def answer(self, name: str, inputs: dict[str, torch.Tensor], max_new_tokens: int | None = None) -> tuple[str, Any]:
        """Greedy answer of pipeline ``name`` to ``inputs``; returns the text and the generation stats."""
        torch.manual_seed(self.seed)
        cache = self.cache(name)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        new, stats = generate(self.model, inputs, cache, max_new_tokens=max_new_tokens or self.max_new_tokens, do_sample=False,
                              temperature=None, top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id)
        return self.tokenizer.decode(new[0], skip_special_tokens=True), stats

    def context_limit(self) -> int | None:
        config = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        return getattr(config, "max_position_embeddings", None)

    def check_length(self, tokens: int, what: str, new_tokens: int | None = None) -> None:
        limit = self.context_limit()
        new_tokens = self.max_new_tokens if new_tokens is None else new_tokens
        if tokens < 16:
            raise EvalError(f"{what} {tokens} is too short; use at least 16 tokens")
        if limit is not None and tokens + new_tokens > limit:
            raise EvalError(
                f"{what} {tokens} plus {new_tokens} new tokens exceeds the model's context of {limit} tokens "
                f"(max_position_embeddings); use at most {limit - new_tokens}"
            )

    def run_cells(self, task: str, cells: list[tuple[str, tuple[Any, ...]]], work: Callable[[str, tuple[Any, ...]], dict[str, Any]]) -> None:
        """Run every ``(pipeline, cell)`` not in the run folder yet, with a progress bar; ``work`` returns its record."""
        keyed = [(key(task, name, *cell), name, cell) for name, cell in cells]
        todo = [item for item in keyed if self.run.get(item[0]) is None]
        with self.bar(len(keyed), len(keyed) - len(todo), task) as bar:
            for cell_key, name, cell in todo:
                if self.pipeline(name) is None:
                    bar.update(1)
                    continue
                bar.set_postfix_str(name, refresh=False)
                start = time.perf_counter()
                record = work(name, cell)
                self.run.add(cell_key, {"task": task, "pipeline": name, **record, "seconds": time.perf_counter() - start})
                bar.update(1)



# ------------------------------------------------------------------------------------------ needle
def run_needle(ev: Evaluation, lengths: list[int], depths: list[float], count: int) -> dict[str, Any]:
    for length in lengths:
        ev.check_length(length, "needle length")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise EvalError(f"needle depth {depth} is outside 0..1")
    text = essays_text()
    needles = datasets.make_needles(count, ev.seed)
    prompts: dict[tuple[int, float, int], dict[str, torch.Tensor]] = {}

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        length, depth, index = cell
        if (length, depth, index) not in prompts:
            prompt = datasets.needle_prompt_text(ev.tokenizer, text, needles[index], index, length, depth, ev.seed)
            prompts[(length, depth, index)] = ev.encode_prompt(prompt)
        inputs = prompts[(length, depth, index)]
        answer, stats = ev.answer(name, inputs)
        needle = needles[index]
        return {"length": length, "depth": depth, "needle": index, "expected": needle.answer, "answer": answer,
                "hit": scoring.needle_hit(answer, needle.answer), "prompt_tokens": stats.prompt_tokens,
                "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes}

    cells = [(name, (length, depth, index)) for name in ev.pipelines for length in lengths for depth in depths for index in range(count)]
    ev.run_cells("needle", cells, work)
    return needle_result(ev.run, ev.pipelines, ev.errors, model_label(ev.model), lengths, depths, count)


def needle_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], label: str,
                  lengths: list[int], depths: list[float], count: int) -> dict[str, Any]:
    """needle.json and a heatmap per pipeline from the run folder's cells."""
    needles = [attrs.asdict(n) for n in datasets.make_needles(count, run.settings.get("seed", 0))]
    result: dict[str, Any] = {"lengths": lengths, "depths": depths, "needles": needles, "pipelines": {}}
    for name in pipelines:
        rows = [r for r in run.records("needle", name) if r["length"] in lengths and r["depth"] in depths and r["needle"] < count]
        if name in errors or not rows:
            result["pipelines"][name] = {"error": errors.get(name, "not run")}
            continue
        grid = [[_mean(r["hit"] for r in rows if r["depth"] == d and r["length"] == n) for n in lengths] for d in depths]
        result["pipelines"][name] = {"accuracy": _mean(r["hit"] for r in rows), "hits": sum(r["hit"] for r in rows),
                                     "cells": len(rows), "grid": grid, "answers": rows}
    run.write_json("needle.json", result)
    for name, data in result["pipelines"].items():
        if "grid" in data:
            needle_heatmap(run.path / f"needle_{_slug(name)}.png", name, data["grid"], lengths, depths, count, label)
    return result


def _mean(values: Iterable[float]) -> float:
    values = [float(v) for v in values]
    return sum(values) / len(values) if values else float("nan")


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def model_label(model: Any) -> str:
    """What the plots and tables call the model: the name kvweave loaded it under (see ``cmd_eval``)."""
    label = getattr(model, "_kvweave_label", None)
    if label:
        return label
    return str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model")).rstrip("/").split("/")[-1]


# ---------------------------------------------------------------------------------------------- QA
def run_qa(ev: Evaluation, names: list[str], samples: int, length: int) -> dict[str, Any]:
    unknown = [n for n in names if n not in datasets.QA_BUILDERS]
    if unknown:
        raise EvalError(f"unknown QA datasets {unknown}; known: {', '.join(datasets.QA_BUILDERS)}")
    if samples < 1:
        raise EvalError(f"--qa-samples must be at least 1, got {samples}")
    ev.check_length(length, "QA context length")
    built = {name: datasets.QA_BUILDERS[name](ev.tokenizer, samples, length, ev.seed) for name in names}
    by_id = {(d, s.id): s for d, items in built.items() for s in items}

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        dataset, sample_id = cell
        sample = by_id[(dataset, sample_id)]
        answer, stats = ev.answer(name, ev.encode_prompt(datasets.qa_prompt(sample)))
        prediction = scoring.clean_prediction(answer)
        em, f1 = scoring.best_scores(prediction, sample.answers)
        return {"dataset": dataset, "id": sample_id, "question": sample.question, "answers": list(sample.answers),
                "answer": answer, "prediction": prediction, "em": em, "f1": f1, "prompt_tokens": stats.prompt_tokens,
                "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes}

    cells = [(name, (dataset, s.id)) for name in ev.pipelines for dataset in names for s in built[dataset]]
    ev.run_cells("qa", cells, work)
    return qa_result(ev.run, ev.pipelines, ev.errors, names, samples, length, wanted=set(by_id))


def qa_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], names: list[str], samples: int, length: int,
              wanted: set[tuple[str, str]] | None = None) -> dict[str, Any]:
    """qa.json from the run folder's cells (``wanted``: the (dataset, id) pairs of this run; None: all)."""
    result: dict[str, Any] = {"datasets": names, "samples": samples, "length": length, "pipelines": {}}
    for name in pipelines:
        rows = [r for r in run.records("qa", name) if r["dataset"] in names and (wanted is None or (r["dataset"], r["id"]) in wanted)]
        if name in errors or not rows:
            result["pipelines"][name] = {"error": errors.get(name, "not run")}
            continue
        entry: dict[str, Any] = {}
        for dataset in names:
            part = [r for r in rows if r["dataset"] == dataset]
            entry[dataset] = {"em": _mean(r["em"] for r in part), "f1": _mean(r["f1"] for r in part), "n": len(part)}
        entry["answers"] = rows
        result["pipelines"][name] = entry
    run.write_json("qa.json", result)
    return result


# ---------------------------------------------------------------------------------------- ppl text
def essay_ids(ev: Evaluation, tokens: int) -> torch.Tensor:
    """``tokens`` ids [1, T] of the essays from character ``PPL_OFFSET`` on (a sentence start)."""
    text = essays_text()
    start = PPL_OFFSET + next((b for b in metrics.sentence_boundaries(text[PPL_OFFSET : PPL_OFFSET + 5000]) if b > 0), 0)
    ids = leading_token_ids(ev.tokenizer, text[start:], tokens)
    if len(ids) < tokens:
        raise EvalError(f"the essays hold only {len(ids)} tokens after character {PPL_OFFSET}, fewer than --tokens {tokens}")
    return torch.tensor([ids])


def run_ppl(ev: Evaluation, tokens: int, chunk: int) -> dict[str, Any]:
    ev.check_length(tokens, "--tokens", 0)
    if not 1 <= chunk <= tokens:
        raise EvalError(f"--chunk must be in 1..{tokens}, got {chunk}")
    ids = essay_ids(ev, tokens)
    reference_key = key("ppl", "DynamicCache", tokens, chunk)
    if ev.run.get(reference_key) is None:
        ev.say("perplexity with a DynamicCache (the reference)")
        ev.run.add(reference_key, {"task": "ppl", "pipeline": "DynamicCache", "ppl": metrics.perplexity(ev.model, None, ids, chunk)})
    reference = ev.run.get(reference_key)["ppl"]

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        torch.manual_seed(ev.seed)
        cache = ev.cache(name)
        ppl = metrics.perplexity(ev.model, cache, ids, chunk)
        return {"ppl": ppl, "ppl_delta": ppl - reference, "stored_bytes": cache.memory_bytes(),
                "full_16bit_bytes": cache.full_cache_bytes_16bit(), "breakdown": cache.memory_breakdown()}

    ev.run_cells("ppl", [(name, (tokens, chunk)) for name in ev.pipelines], work)
    return ppl_result(ev.run, ev.pipelines, ev.errors, tokens, chunk)


def ppl_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], tokens: int, chunk: int) -> dict[str, Any]:
    reference = run.get(key("ppl", "DynamicCache", tokens, chunk))
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "dynamic_cache_ppl": reference and reference["ppl"], "pipelines": {}}
    result["pipelines"] = _single_cells(run, "ppl", pipelines, errors, tokens, chunk)
    run.write_json("ppl.json", result)
    return result


def _single_cells(run: RunFolder, task: str, pipelines: list[str], errors: dict[str, str], *cell: Any) -> dict[str, Any]:
    out = {}
    for name in pipelines:
        record = run.get(key(task, name, *cell))
        out[name] = {"error": errors.get(name, "not run")} if record is None or name in errors else _strip(record)
    return out


def _strip(record: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in record.items() if k not in ("key", "task", "pipeline")}


# ---------------------------------------------------------------------------------------- fidelity
def run_fidelity(ev: Evaluation, tokens: int, chunk: int, probe: int) -> dict[str, Any]:
    ev.check_length(tokens, "--tokens", 0)
    if not 1 <= probe <= tokens:
        raise EvalError(f"--probe must be in 1..{tokens}, got {probe}")
    if not 1 <= chunk <= tokens:
        raise EvalError(f"--chunk must be in 1..{tokens}, got {chunk}")
    ids = essay_ids(ev, tokens)
    reference: dict[str, Any] = {}

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        if not reference:
            ev.say("reference pass (DynamicCache) for the attention-output error")
            reference.update(metrics.reference_pass(ev.model, ids.to(ev.device), chunk, tokens // 2, probe))
        torch.manual_seed(ev.seed)
        out = metrics.attention_output_error(ev.model, ev.tokenizer, ev._resolved[name], ids, ev.device, chunk=chunk, probe=probe,
                                             reference=reference)
        return {"error": out["mean"], "per_layer": out["per_layer"], "per_head": out["per_head"], "stored_bytes": out["memory_bytes"],
                "full_16bit_bytes": out["full_16bit_bytes"], "breakdown": out["breakdown"]}

    ev.run_cells("fidelity", [(name, (tokens, chunk, probe)) for name in ev.pipelines], work)
    return fidelity_result(ev.run, ev.pipelines, ev.errors, model_label(ev.model), tokens, chunk, probe)


def fidelity_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], label: str, tokens: int, chunk: int,
                    probe: int) -> dict[str, Any]:
    result: dict[str, Any] = {"tokens": tokens, "chunk": chunk, "probe": probe,
                              "pipelines": _single_cells(run, "fidelity", pipelines, errors, tokens, chunk, probe)}
    run.write_json("fidelity.json", result)
    fidelity_plot(run.path / "fidelity.png", result, label)
    return result


# ------------------------------------------------------------------------------------------- speed
def run_speed(ev: Evaluation, tokens: int, new_tokens: int) -> dict[str, Any]:
    ev.check_length(tokens, "--speed-tokens", new_tokens)
    if new_tokens < 2:
        raise EvalError(f"--speed-new-tokens must be at least 2 (decode speed needs a step after the first token), got {new_tokens}")
    ids = essay_ids(ev, tokens)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    warmed: list[bool] = []

    def work(name: str, cell: tuple[Any, ...]) -> dict[str, Any]:
        if not warmed:  # first use of kernels at these shapes, allocator and caches: a whole untimed generation
            ev.answer(name, inputs, 4)
            warmed.append(True)
        cuda = ev.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(ev.device)
            torch.cuda.reset_peak_memory_stats(ev.device)
            before = torch.cuda.memory_allocated(ev.device)
        _, stats = ev.answer(name, inputs, new_tokens)
        record = {"ttft_seconds": stats.prefill_seconds, "decode_tokens_per_second": stats.decode_tokens_per_second,
                  "generated_tokens": stats.generated_tokens, "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes,
                  "breakdown": stats.breakdown}
        if cuda:
            record["peak_extra_bytes"] = torch.cuda.max_memory_allocated(ev.device) - before
        return record

    ev.run_cells("speed", [(name, (tokens, new_tokens)) for name in ev.pipelines], work)
    return speed_result(ev.run, ev.pipelines, ev.errors, tokens, new_tokens)


def speed_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], tokens: int, new_tokens: int) -> dict[str, Any]:
    result: dict[str, Any] = {"tokens": tokens, "new_tokens": new_tokens,
                              "pipelines": _single_cells(run, "speed", pipelines, errors, tokens, new_tokens)}
    run.write_json("speed.json", result)
    return result


def ablation_pipelines(registry: Registry, base: str) -> list[str]:
    """``full``, ``base`` and every pipeline whose ``extends`` chain reaches ``base``."""
    if base not in registry.names():
        raise EvalError(f"--ablations {base}: no such pipeline; known: {', '.join(registry.names())}")
    children = [name for name in registry.names() if name != base and base in registry.resolve(name).chain]
    if not children:
        raise EvalError(f"--ablations {base}: no pipeline extends '{base}'")
    return list(dict.fromkeys(["full", base, *children]))


# -------------------------------------------------------------------------------------------- CLI
def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from exc


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _task_settings(args: argparse.Namespace, task: str) -> dict[str, Any]:
    if task == "needle":
        return {"lengths": args.lengths, "depths": args.depths, "needles": args.needles}
    if task == "qa":
        return {"datasets": args.datasets, "qa_samples": args.qa_samples, "qa_length": args.qa_length}
    if task in ("ppl", "fidelity"):
        return {"tokens": args.tokens, "chunk": args.chunk, **({"probe": args.probe} if task == "fidelity" else {})}
    return {"speed_tokens": args.speed_tokens, "speed_new_tokens": args.speed_new_tokens}


def _model_label_for(spec: str) -> str:
    """The model's name in tables and plots: SmolLM2-135M-Instruct for ``default``, else the folder or file name."""
    from kvweave.tools.models import DEFAULT_MODEL, DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME if spec == DEFAULT_MODEL else Path(spec.rstrip("/")).name


def _model_slug(spec: str) -> str:
    return re.sub(r"[^a-z0-9._-]+", "-", _model_label_for(spec).lower()).strip("-") or "model"


def command_line(argv: list[str] | None) -> str:
    return shlex.join(["kvweave", *(sys.argv[1:] if argv is None else argv)])


def cmd_eval(args: argparse.Namespace) -> int:
    from kvweave.tools.models import emulate_bf16_gemm, load_model

    registry = load_registry(args.registry)
    tasks = [args.task] if args.task != "table" else _names(args.tasks)
    bad = [t for t in tasks if t not in TASKS]
    if bad:
        raise EvalError(f"--tasks {bad} unknown; tasks are {', '.join(TASKS)}")
    base = getattr(args, "ablations", None)
    if base is not None:
        names = ablation_pipelines(registry, base)
    else:
        names = _names(args.pipelines)
    unknown = [n for n in names if n not in registry.names()]
    if unknown or not names:
        raise EvalError(f"unknown pipelines {unknown or '(none given)'}; known: {', '.join(registry.names())}")
    if args.max_new_tokens < 1:
        raise EvalError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    settings: dict[str, Any] = {"task": args.task, "ablations": base, "model": args.model, "dtype": args.dtype, "device": args.device, "seed": args.seed,
                                "max_new_tokens": args.max_new_tokens, "chat": args.chat, "registry": args.registry}
    for task in tasks:
        settings[task] = _task_settings(args, task)
    label = args.task if base is None else f"{args.task}-ablations-{base}"
    out = Path(args.out) if args.out else Path("results") / "eval" / f"{label}-{_model_slug(args.model)}-{args.device.replace(':', '')}"
    command = command_line(getattr(args, "argv", None))
    run = RunFolder(out, settings, names, command, args.device, fresh=args.fresh)
    done = len(run.cells)
    print(f"kvweave eval {args.task}: {len(names)} pipelines -> {out}" + (f" (resuming: {done} cells done)" if done else ""), file=sys.stderr)
    torch.manual_seed(args.seed)
    dtype = None if args.dtype == "auto" else getattr(torch, args.dtype)
    model, tokenizer = load_model(args.model, device=args.device, dtype=dtype, progress=True)
    model._kvweave_label = _model_label_for(args.model)
    if model.dtype == torch.bfloat16 and args.device == "cpu":
        emulate_bf16_gemm(model)  # same products, fp32 accumulation as a bf16 GEMM: ~50x faster on AVX2 CPUs
    ev = Evaluation(model, tokenizer, registry, names, run, seed=args.seed, max_new_tokens=args.max_new_tokens, chat=args.chat)
    try:
        results = run_tasks(ev, args, tasks)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {len(run.cells)} cells are saved in {out}; run the same command to resume", file=sys.stderr)
        return 130
    if args.task == "table":
        print(write_table(run, names, ev.errors, results, base, model_label(model)))
    print(f"results in {out}", file=sys.stderr)
    return 0


def report(path: Path, ablations: str | None = None) -> dict[str, dict[str, Any]]:
    """Rebuild every output of a results folder from its cells (no model needed): the task JSON files,
    the plots and, for a ``table`` run, the table. Pipelines or cells that never finished show as not run."""
    run = RunFolder.existing(path)
    settings = run.settings
    pipelines = list(run.record.get("pipelines", []))
    label = _model_label_for(settings["model"])
    results: dict[str, dict[str, Any]] = {}
    for task in TASKS:
        opts = settings.get(task)
        if opts is None:
            continue
        if task == "needle":
            results[task] = needle_result(run, pipelines, {}, label, opts["lengths"], opts["depths"], opts["needles"])
        elif task == "qa":
            results[task] = qa_result(run, pipelines, {}, opts["datasets"], opts["qa_samples"], opts["qa_length"])
        elif task == "ppl":
            results[task] = ppl_result(run, pipelines, {}, opts["tokens"], opts["chunk"])
        elif task == "fidelity":
            results[task] = fidelity_result(run, pipelines, {}, label, opts["tokens"], opts["chunk"], opts["probe"])
        else:
            results[task] = speed_result(run, pipelines, {}, opts["speed_tokens"], opts["speed_new_tokens"])
    if settings["task"] == "table":
        print(write_table(run, pipelines, {}, results, ablations or settings.get("ablations"), label))
    return results


def cmd_report(args: argparse.Namespace) -> int:
    report(Path(args.folder), args.ablations)
    print(f"outputs rebuilt in {args.folder}", file=sys.stderr)
    return 0


def run_tasks(ev: Evaluation, args: argparse.Namespace, tasks: list[str]) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for task in TASKS:
        if task not in tasks:
            continue
        if task == "needle":
            results[task] = run_needle(ev, args.lengths, args.depths, args.needles)
        elif task == "qa":
            results[task] = run_qa(ev, args.datasets, args.qa_samples, args.qa_length)
        elif task == "ppl":
            results[task] = run_ppl(ev, args.tokens, args.chunk)
        elif task == "fidelity":
            results[task] = run_fidelity(ev, args.tokens, args.chunk, args.probe)
        else:
            results[task] = run_speed(ev, args.speed_tokens, args.speed_new_tokens)
        summary = ", ".join(f"{n}: {_summary(task, r)}" for n, r in results[task]["pipelines"].items())
        ev.say(f"{task}: {summary}")
    return results


def _summary(task: str, result: dict[str, Any]) -> str:
    if "accuracy" in result:
        return f"{result['accuracy']:.2f}"
    if "ppl" in result:
        return f"{result['ppl']:.2f}"
    if isinstance(result.get("error"), float):
        return f"{result['error']:.3f}"
    if "ttft_seconds" in result:
        return f"TTFT {result['ttft_seconds']:.2f} s, {result['decode_tokens_per_second']:.1f} tok/s"
    if "error" in result:
        return "error"
    return "/".join(f"{v['f1']:.2f}" for v in result.values() if isinstance(v, dict) and "f1" in v)


def _add_common(p: argparse.ArgumentParser, table: bool) -> None:
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--pipelines", help="comma-separated pipeline names")
    which.add_argument("--ablations", metavar="BASE", help="full, BASE and every pipeline that extends BASE (the Table-2 equivalent)")
    if table:
        p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated subset of {','.join(TASKS)}")
    p.add_argument("--registry", help="a registry.toml of your own, read on top of the built-in one")
    p.add_argument("--model", default="default", help="'default', a local HF folder, a .gguf file, or a hub id")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="bfloat16", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (the exact window is stored in it); bfloat16 on a CPU runs its GEMMs in fp32")
    p.add_argument("--seed", type=int, default=0, help="seeds needles, QA sampling and every component's randomness")
    p.add_argument("--max-new-tokens", type=int, default=24, help="answer length for needle and QA")
    p.add_argument("--no-chat", dest="chat", action="store_false", help="do not wrap prompts in the chat template")
    p.add_argument("--out", help="results folder (default results/eval/<task>-<model>-<device>); rerun to resume")
    p.add_argument("--fresh", action="store_true", help="discard what the results folder holds and start over")


def _add_task_options(p: argparse.ArgumentParser, task: str) -> None:
    if task == "needle":
        p.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8000], help="context lengths in tokens")
        p.add_argument("--depths", type=_floats, default=[0.0, 0.25, 0.5, 0.75, 1.0], help="needle depths in 0..1")
        p.add_argument("--needles", type=int, default=3, help="distinct needles per (length, depth) cell")
    elif task == "qa":
        p.add_argument("--datasets", type=_names, default=["hotpotqa", "squad"], help="hotpotqa, squad")
        p.add_argument("--qa-samples", type=int, default=25, help="questions per dataset")
        p.add_argument("--qa-length", type=int, default=4096, help="context length in tokens (prompt included)")
    elif task in ("ppl", "fidelity"):
        if not any(a.dest == "tokens" for a in p._actions):
            p.add_argument("--tokens", type=int, default=4096, help="essay tokens fed to the cache")
            p.add_argument("--chunk", type=int, default=64, help="tokens per forward while feeding")
        if task == "fidelity":
            p.add_argument("--probe", type=int, default=32, help="query positions Eq. (3) is measured for")
    else:
        p.add_argument("--speed-tokens", type=int, default=4096, help="prompt tokens for time to first token and decode speed")
        p.add_argument("--speed-new-tokens", type=int, default=64, help="tokens generated for the decode speed")


def add_eval_command(subparsers: Any) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("eval", help="needle, QA, perplexity, fidelity and speed of pipelines; tables and plots")
    tasks = parser.add_subparsers(dest="task", required=True)
    helps = {
        "needle": "needle in a haystack over lengths x depths; heatmap per pipeline",
        "qa": "extractive QA (HotpotQA, SQuAD) over long distractor contexts; EM and F1",
        "ppl": "perplexity of essay text with the cache compressing as it fills, against a DynamicCache",
        "fidelity": "Eq. (3) attention-output relative error per layer and overall",
        "speed": "time to first token, decode tokens/s and stored bytes of one generation",
        "table": "several tasks for several pipelines: Markdown table, CSV, quality-vs-memory plot",
    }
    for task, text in helps.items():
        p = tasks.add_parser(task, help=text, description=text)
        _add_common(p, table=task == "table")
        for option_task in (TASKS if task == "table" else (task,)):
            _add_task_options(p, option_task)
        p.set_defaults(func=cmd_eval)
    p = tasks.add_parser("report", help="rebuild the JSON files, plots and table of a results folder from its cells",
                         description="Rebuild the outputs of a results folder (also a partial one) from cells.jsonl; no model is loaded.")
    p.add_argument("folder", help="a results folder written by kvweave eval")
    p.add_argument("--ablations", metavar="BASE", help="show the table's deltas against BASE (default: the run's own --ablations)")
    p.set_defaults(func=cmd_report)
    return parser
