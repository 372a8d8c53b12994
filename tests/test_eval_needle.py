"""``kvweave eval needle``: the query-agnostic protocol (context prefilled and compressed before the question
is read), the prompt split, multi-key haystacks, relative-to-full scores; a tiny random model on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvweave.core.errors import KvweaveError
from kvweave.tools import cli, datasets, eval_context, eval_folder, eval_needle, metrics, scoring
from kvweave.tools.data import essays_text


def _evaluation(tokenizer, chat: bool = True) -> eval_context.Evaluation:
    return eval_context.Evaluation(None, tokenizer, None, [], None, chat=chat, progress=False)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize("keys", [1, 3])
def test_the_split_gives_the_prompts_ids_with_the_question_in_the_second_part(tokenizer, chat, keys):
    ev = _evaluation(tokenizer, chat)
    assert ev.chat is chat  # the default tokenizer has a chat template
    text, needles = essays_text(), datasets.make_needles(3, seed=0)
    for length, depth, index in ((300, 0.0, 0), (500, 0.5, 1), (700, 1.0, 2)):
        cell = datasets.needle_cell(tokenizer, text, needles[index], index, length, depth, seed=0, keys=keys)
        inputs, split = ev.encode_split(cell.context, cell.question)
        ids = inputs["input_ids"][0].tolist()
        assert ids == ev.encode_prompt(cell.context + cell.question)["input_ids"][0].tolist()  # the whole prompt's ids
        context_ids = ids[:split]
        question_ids = ids[split:]
        # tokenized apart, the context part gives the prompt's first ids: all of them, or all but the one token
        # that spans the split (a needle ending the haystack: "." and the blank line merge), which then moves
        # to the question part, so every question token is read after compression
        templated = ev.templated(cell.context + cell.question)
        at = templated.rfind(cell.question)
        alone = tokenizer(templated[:at], add_special_tokens=not chat)["input_ids"]
        assert context_ids == alone[: len(context_ids)] and len(alone) - len(context_ids) <= 1
        if len(alone) == len(context_ids):
            assert tokenizer(templated[at:], add_special_tokens=False)["input_ids"] == question_ids
        assert tokenizer.decode(question_ids).endswith(tokenizer.decode(tokenizer(templated[at:], add_special_tokens=False)["input_ids"])[-20:])
        question_text = tokenizer.decode(question_ids)
        assert cell.needle.question in question_text and "Question:" not in tokenizer.decode(context_ids)
        assert all(n.sentence in tokenizer.decode(context_ids) for n in cell.needles)
        if chat:
            assert question_text.endswith("<|im_start|>assistant\n") and "<|im_end|>" in question_text
            assert tokenizer.decode(context_ids).startswith("<|im_start|>")


def test_a_token_spanning_the_split_goes_to_the_question_part(tokenizer):
    ev = _evaluation(tokenizer, chat=False)
    context, question = "Paul Graham wrote about programming langu", "ages. Which ones?"
    whole = tokenizer(context + question)["input_ids"]
    assert tokenizer(context)["input_ids"] + tokenizer(question, add_special_tokens=False)["input_ids"] != whole  # the case
    inputs, split = ev.encode_split(context, question)
    ids = inputs["input_ids"][0].tolist()
    assert ids == whole and 0 < split < len(ids)
    assert context.startswith(tokenizer.decode(ids[:split]))  # the first part is context only
    assert tokenizer.decode(ids[split:]).endswith(question) and question not in tokenizer.decode(ids[:split])


def test_a_question_the_chat_template_rewrites_is_refused(tokenizer):
    ev = _evaluation(tokenizer)
    with pytest.raises(eval_folder.EvalError, match="--query-aware"):
        ev.encode_split("Some context.", "")


# ------------------------------------------------------------------------------------------ multi-key
def test_a_multi_key_haystack_holds_k_distinct_facts_and_asks_one(tokenizer):
    text, needles = essays_text(), datasets.make_needles(4, seed=0)
    count = lambda s: len(tokenizer(s, add_special_tokens=False)["input_ids"])  # noqa: E731
    asked_positions = set()
    for depth in (0.0, 0.5, 0.9):
        cell = datasets.needle_cell(tokenizer, text, needles[2], 2, 900, depth, seed=0, keys=4)
        assert len(cell.needles) == 4 and cell.needle == needles[2]
        assert cell.depths[cell.asked] == depth and list(cell.depths) == sorted(cell.depths)
        assert len({n.question for n in cell.needles}) == 4 and len({n.answer for n in cell.needles}) == 4
        for n in cell.needles:
            assert cell.context.count(n.sentence) == 1 and n.sentence not in cell.question
        others = [n for n in cell.needles if n != cell.needle]
        assert cell.needle.question in cell.question and not any(n.question in cell.question for n in others)
        assert not any(scoring.needle_hit(n.answer, cell.needle.answer) or scoring.needle_hit(cell.needle.answer, n.answer) for n in others)
        starts = [cell.context.index(n.sentence) for n in cell.needles]
        assert starts == sorted(starts)  # in haystack order, as their depths
        intro = count(metrics.PROMPT_INTRO)
        haystack = count(cell.context) - intro - sum(count(" " + n.sentence) for n in cell.needles)
        for n, where in zip(cell.needles, cell.depths):
            assert abs((count(cell.context[: cell.context.index(n.sentence)]) - intro) / haystack - where) <= 0.12
        assert 850 <= count(cell.context + cell.question) <= 950
        asked_positions.add(cell.asked)
    assert asked_positions == {0, 2, 3}  # which of the four is asked moves with the cell (first, middle, last)
    one = datasets.needle_cell(tokenizer, text, needles[2], 2, 900, 0.5, seed=0, keys=1)
    assert one.context + one.question == datasets.needle_prompt_text(tokenizer, text, needles[2], 2, 900, 0.5, seed=0)


def test_needles_and_key_groups_never_share_a_key_or_a_value():
    needles = datasets.make_needles(datasets.MAX_NEEDLES, seed=5)
    assert len({n.question for n in needles}) == datasets.MAX_NEEDLES
    assert not any(a.answer.lower() in b.answer.lower() for i, a in enumerate(needles) for j, b in enumerate(needles) if i != j)
    for index, needle in enumerate(needles[:12]):
        group = datasets.key_group(needle, index, datasets.MAX_KEYS, seed=5)
        assert group[0] == needle and len(group) == datasets.MAX_KEYS
        assert len({n.question for n in group}) == len(group) and len({n.template for n in group}) == datasets.NEEDLE_TEMPLATES
        assert not any(a.answer.lower() in b.answer.lower() for i, a in enumerate(group) for j, b in enumerate(group) if i != j)
    assert datasets.key_group(needles[0], 0, 3, seed=5) == datasets.key_group(needles[0], 0, 3, seed=5)
    assert datasets.key_group(needles[0], 0, 3, seed=5) != datasets.key_group(needles[0], 1, 3, seed=5)
    with pytest.raises(KvweaveError, match="--needles"):
        datasets.make_needles(datasets.MAX_NEEDLES + 1, seed=0)
    with pytest.raises(KvweaveError, match="--keys"):
        datasets.key_group(needles[0], 0, 0, seed=0)


# ----------------------------------------------------------------------------------------- protocols
def _needle_args(folder: Path, out: Path, *extra: str) -> list[str]:
    return ["eval", "needle", "--model", str(folder), "--pipelines", "full,int4,snapkv", "--lengths", "400", "--depths", "0.5",
            "--needles", "1", "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out), *extra]


@pytest.fixture
def forwards(monkeypatch):
    """Per pipeline and cell, each forward's layer-0 update: its new tokens, the packed tokens and the tokens
    the cache held when it started, and whether the K it attended over ends with its own keys, exact."""
    log: dict[str, list[list[dict]]] = {}
    real = eval_context.Evaluation.cache

    def cache(self, name):
        built = real(self, name)
        engine, update = built.engine, built.engine.update
        cell: list[dict] = []
        log.setdefault(name, []).append(cell)

        def recording(layer, keys, values, materialize=True):
            if layer != 0:
                return update(layer, keys, values, materialize)
            view = engine.view(0)
            packed, held = view.packed_tokens, engine.seq_length(0) if view.keys.exact is not None else 0
            out = update(layer, keys, values, materialize)
            n = keys.shape[-2]
            cell.append({"new": n, "packed_before": packed, "held_before": held, "exact": bool(torch.equal(out[0][..., -n:, :], keys))})
            return out

        engine.update = recording
        return built

    monkeypatch.setattr(eval_context.Evaluation, "cache", cache)
    return log


def test_query_agnostic_compresses_the_context_before_the_question_is_read(tiny_model_folder, tmp_path, forwards):
    out = tmp_path / "agnostic"
    assert cli.main(_needle_args(tiny_model_folder, out)) == 0
    result = json.loads((out / "needle.json").read_text())
    assert result["protocol"] == "query-agnostic"
    for name in ("full", "int4", "snapkv"):
        (record,) = result["pipelines"][name]["answers"]
        context, total = record["context_tokens"], record["prompt_tokens"]
        assert record["protocol"] == "query-agnostic" and 350 < context < total
        (cell,) = forwards[name]
        prefill, question, *decode = cell
        assert prefill == {"new": context, "packed_before": 0, "held_before": 0, "exact": True}
        # the question arrives in one forward, after the context, over what the cache kept of it ...
        assert question["new"] == total - context and question["held_before"] == context
        # ... and attends to its own tokens exactly: the first answer token comes out of this forward
        assert question["exact"]
        assert [f["new"] for f in decode] == [1] * (len(decode)) and len(decode) == 1  # 2 new tokens: one decode step
        if name == "full":
            assert question["packed_before"] == 0
        else:
            assert 0 < question["packed_before"] <= context  # compressed before the question was read
    settings = json.loads((out / "settings.json").read_text())
    assert settings["settings"]["needle"]["protocol"] == "query-agnostic" and settings["settings"]["needle"]["keys"] == 1
    # another protocol is another run: the folder refuses it rather than mixing cells
    assert cli.main(_needle_args(tiny_model_folder, out, "--query-aware")) == 2


def test_query_aware_reads_the_whole_prompt_in_one_prefill(tiny_model_folder, tmp_path, forwards):
    out = tmp_path / "aware"
    assert cli.main(_needle_args(tiny_model_folder, out, "--query-aware")) == 0
    result = json.loads((out / "needle.json").read_text())
    assert result["protocol"] == "query-aware"
    assert json.loads((out / "settings.json").read_text())["settings"]["needle"]["protocol"] == "query-aware"
    for name in ("full", "int4", "snapkv"):
        (record,) = result["pipelines"][name]["answers"]
        assert record["context_tokens"] == 0
        (cell,) = forwards[name]
        assert cell[0] == {"new": record["prompt_tokens"], "packed_before": 0, "held_before": 0, "exact": True}
        assert [f["new"] for f in cell[1:]] == [1]


def test_multi_key_runs_and_the_table_says_which_protocol_made_it(tiny_model_folder, tmp_path):
    out = tmp_path / "table"
    args = ["eval", "table", "--tasks", "needle", "--model", str(tiny_model_folder), "--pipelines", "full,int4", "--lengths",
            "300", "--depths", "0,1", "--needles", "2", "--keys", "3", "--max-new-tokens", "2", "--dtype", "float32", "--out", str(out)]
    assert cli.main(args) == 0
    result = json.loads((out / "needle.json").read_text())
    assert (result["protocol"], result["keys"]) == ("query-agnostic", 3)
    answers = result["pipelines"]["int4"]["answers"]
    assert len(answers) == 4 and all(len(r["others"]) == 2 and r["expected"] not in r["others"] for r in answers)
    assert {r["asked"] for r in answers} == {0, 2}  # the asked fact first at depth 0, last at depth 1
    table = (out / "table.md").read_text()
    assert "needle protocol: query-agnostic" in table and "3 needles per haystack" in table
    assert "found of what full finds" in table
    assert json.loads((out / "settings.json").read_text())["settings"]["needle"]["keys"] == 3
    assert cli.main(["eval", "report", str(out)]) == 0  # rebuilt from the cells with the run's protocol
    assert "needle protocol: query-agnostic" in (out / "table.md").read_text()


# ------------------------------------------------------------------------------------ against full
def _record(run: eval_folder.RunFolder, name: str, length: int, depth: float, index: int, hit: bool) -> None:
    run.add(eval_folder.key("needle", name, length, depth, index), {"task": "needle", "pipeline": name, "length": length,
                                                                   "depth": depth, "needle": index, "hit": hit})


def test_scores_relative_to_full_and_a_warning_where_full_misses(tmp_path, capsys):
    run = eval_folder.RunFolder(tmp_path, {"seed": 0}, ["full", "int4"], "x", "cpu")
    full = {(100, 0.5, 0): True, (100, 0.5, 1): True, (200, 0.5, 0): True, (200, 0.5, 1): False}
    int4 = {(100, 0.5, 0): True, (100, 0.5, 1): False, (200, 0.5, 0): False, (200, 0.5, 1): True}
    for name, hits in (("full", full), ("int4", int4)):
        for cell, hit in hits.items():
            _record(run, name, *cell, hit)
    result = eval_needle.needle_result(run, ["full", "int4"], {}, "tiny", [100, 200], [0.5], 2, "query-agnostic", 1)
    # int4 found 1 of the 3 needles full found; its hit where full missed does not count
    assert result["pipelines"]["int4"]["of_full"] == {"found": 1, "full_found": 3, "fraction": pytest.approx(1 / 3)}
    assert result["pipelines"]["int4"]["accuracy"] == 0.5 and result["pipelines"]["full"]["of_full"]["fraction"] == 1.0
    assert len(result["warnings"]) == 1 and "200 tokens" in result["warnings"][0] and "50%" in result["warnings"][0]
    assert "warning: needle: the full cache finds 50%" in capsys.readouterr().err
    saved = json.loads((tmp_path / "needle.json").read_text())
    assert saved["protocol"] == "query-agnostic" and saved["warnings"] == result["warnings"]
    note = eval_needle.needle_note(result)
    assert "query-agnostic" in note and "int4 1/3" in note and "- warning:" in note
    without_full = eval_needle.needle_result(run, ["int4"], {}, "tiny", [100, 200], [0.5], 2, "query-agnostic", 1)
    assert "of_full" not in without_full["pipelines"]["int4"] and without_full["warnings"] == []
