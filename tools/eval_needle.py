"""``kvweave eval needle``: needle in a haystack over context lengths x depths x distinct needles; greedy
answers, a hit when the expected value occurs in the answer; ``needle.json`` and a heatmap per pipeline.

Protocols (``protocol`` in the settings, ``needle.json``, every heatmap title and the table's notes):

* ``query-agnostic`` (the default): the context (chat-template prefix, instruction, haystack with the
  needles) is prefilled and compressed first; then the question (with the end of the user turn and the
  assistant prefix) is fed and the answer generated. A method cannot know which fact will be asked.
* ``query-aware`` (``--query-aware``): the whole prompt in one prefill; the cache compresses after that
  forward, so the first answer token sees every prompt token exactly (the question included).

Multi-key (``--keys K``): each haystack holds the asked needle at the cell's depth and ``K - 1`` other
facts (other keys, other values) spread over the other depths; only one is asked.
"""

from __future__ import annotations

import sys
from typing import Any

import attrs
import torch

from kvweave.tools import datasets, scoring
from kvweave.tools.data import essays_text
from kvweave.tools.eval_context import Evaluation, model_label
from kvweave.tools.eval_folder import EvalError, RunFolder, mean, slug
from kvweave.tools.eval_report import needle_heatmap

QUERY_AGNOSTIC = "query-agnostic"
QUERY_AWARE = "query-aware"
PROTOCOLS = (QUERY_AGNOSTIC, QUERY_AWARE)
FULL = "full"  # the uncompressed pipeline other pipelines' hits are compared with
FULL_ENOUGH = 0.95  # below this, the full cache's accuracy at a length says the grid is too hard for the model


def run_needle(ev: Evaluation, lengths: list[int], depths: list[float], count: int, protocol: str = QUERY_AGNOSTIC,
               keys: int = 1) -> dict[str, Any]:
    """Every pipeline x length x depth x needle cell: the needle hidden at ``depth`` of a ``length``-token
    prompt (input_ids [1, T]) with ``keys - 1`` other facts, answered greedily under ``protocol``; writes
    ``needle.json`` and the heatmaps."""
    if protocol not in PROTOCOLS:
        raise EvalError(f"needle protocol {protocol!r} is not one of {', '.join(PROTOCOLS)}")
    for length in lengths:
        ev.check_length(length, "needle length")
    for depth in depths:
        if not 0.0 <= depth <= 1.0:
            raise EvalError(f"needle depth {depth} is outside 0..1")
    text = essays_text()
    needles = datasets.make_needles(count, ev.seed)
    datasets.key_group(needles[0], 0, keys, ev.seed)  # refuses a bad --keys before any work
    prompts: dict[tuple[int, float, int], tuple[datasets.NeedleCell, dict[str, torch.Tensor], int]] = {}

    def prompt(length: int, depth: float, index: int) -> tuple[datasets.NeedleCell, dict[str, torch.Tensor], int]:
        if (length, depth, index) not in prompts:
            cell = datasets.needle_cell(ev.tokenizer, text, needles[index], index, length, depth, ev.seed, keys)
            if protocol == QUERY_AGNOSTIC:
                inputs, split = ev.encode_split(cell.context, cell.question)
            else:
                inputs, split = ev.encode_prompt(cell.context + cell.question), 0
            prompts[(length, depth, index)] = (cell, inputs, split)
        return prompts[(length, depth, index)]

    def work(name: str, cell_key: tuple[Any, ...]) -> dict[str, Any]:
        length, depth, index = cell_key
        cell, inputs, context_tokens = prompt(length, depth, index)
        answer, stats = ev.answer(name, inputs, context_tokens=context_tokens)
        needle = cell.needle
        return {"length": length, "depth": depth, "needle": index, "expected": needle.answer, "answer": answer,
                "hit": scoring.needle_hit(answer, needle.answer), "protocol": protocol, "keys": keys, "asked": cell.asked,
                "others": [n.answer for i, n in enumerate(cell.needles) if i != cell.asked],
                "answered_other": any(scoring.needle_hit(answer, n.answer) for i, n in enumerate(cell.needles) if i != cell.asked),
                "prompt_tokens": stats.prompt_tokens, "context_tokens": context_tokens,
                "stored_bytes": stats.stored_bytes, "full_16bit_bytes": stats.full_16bit_bytes}

    cells = [(name, (length, depth, index)) for name in ev.pipelines for length in lengths for depth in depths for index in range(count)]
    ev.say(f"needle: {protocol}" + (f", {keys} keys per haystack" if keys > 1 else ""))
    ev.run_cells("needle", cells, work)
    return needle_result(ev.run, ev.pipelines, ev.errors, model_label(ev.model), lengths, depths, count, protocol, keys)


def needle_result(run: RunFolder, pipelines: list[str], errors: dict[str, str], label: str, lengths: list[int],
                  depths: list[float], count: int, protocol: str = QUERY_AWARE, keys: int = 1) -> dict[str, Any]:
    """needle.json and a heatmap per pipeline from the run folder's cells. With ``full`` among the
    pipelines, each pipeline's ``of_full`` is what it found of the cells ``full`` found, and a length where
    ``full`` found fewer than 95 % gets a warning (also printed): the grid is too hard for the model there."""
    needles = [attrs.asdict(n) for n in datasets.make_needles(count, run.settings.get("seed", 0))]
    result: dict[str, Any] = {"protocol": protocol, "keys": keys, "lengths": lengths, "depths": depths, "needles": needles,
                              "pipelines": {}, "warnings": []}
    found: dict[str, dict[tuple[Any, ...], bool]] = {}
    for name in pipelines:
        rows = [r for r in run.records("needle", name) if r["length"] in lengths and r["depth"] in depths and r["needle"] < count]
        if name in errors or not rows:
            result["pipelines"][name] = {"error": errors.get(name, "not run")}
            continue
        found[name] = {(r["length"], r["depth"], r["needle"]): bool(r["hit"]) for r in rows}
        grid = [[mean(r["hit"] for r in rows if r["depth"] == d and r["length"] == n) for n in lengths] for d in depths]
        by_length = {str(n): mean(r["hit"] for r in rows if r["length"] == n) for n in lengths}
        result["pipelines"][name] = {"accuracy": mean(r["hit"] for r in rows), "hits": sum(r["hit"] for r in rows),
                                     "cells": len(rows), "by_length": by_length, "grid": grid, "answers": rows}
    if FULL in found:
        reference = found[FULL]
        for name, hits in found.items():
            shared = [cell for cell, hit in reference.items() if hit and cell in hits]
            result["pipelines"][name]["of_full"] = {
                "found": sum(hits[cell] for cell in shared), "full_found": len(shared),
                "fraction": mean(hits[cell] for cell in shared),
            }
        for length, accuracy in result["pipelines"][FULL]["by_length"].items():
            if accuracy < FULL_ENOUGH:
                result["warnings"].append(
                    f"needle: the full cache finds {accuracy:.0%} of the needles at {int(length):,} tokens ({protocol}), below "
                    f"{FULL_ENOUGH:.0%}: the grid is too hard for this model there; compare pipelines by 'of_full' or use shorter lengths"
                )
    run.write_json("needle.json", result)
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    title = protocol + (f", {keys} keys" if keys > 1 else "")
    for name, data in result["pipelines"].items():
        if "grid" in data:
            needle_heatmap(run.path / f"needle_{slug(name)}.png", f"{name} [{title}]", data["grid"], lengths, depths, count, label)
    return result


def needle_note(result: dict[str, Any] | None) -> str:
    """The line a table adds under its needle column: the protocol, keys, and what of ``full``'s finds
    each pipeline found (empty without a needle result)."""
    if not result:
        return ""
    how = ("context prefilled and compressed before the question is read" if result.get("protocol") == QUERY_AGNOSTIC
           else "context and question in one prefill, compressed after it")
    keys = result.get("keys", 1)
    line = f"- needle protocol: {result.get('protocol', QUERY_AWARE)} ({how})"
    if keys > 1:
        line += f"; {keys} needles per haystack, one asked"
    of_full = [f"{name} {data['of_full']['found']}/{data['of_full']['full_found']}"
               for name, data in result["pipelines"].items() if "of_full" in data]
    if of_full:
        line += "; found of what full finds: " + ", ".join(of_full)
    return line + "\n" + "".join(f"- warning: {w}\n" for w in result.get("warnings", []))
