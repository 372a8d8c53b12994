"""Answer scoring as usually defined for SQuAD and HotpotQA, and for needle retrieval.

* :func:`normalize_answer`: lower case, punctuation removed, the articles ``a``/``an``/``the`` removed,
  whitespace collapsed (the normalization of the SQuAD evaluation script, also used by HotpotQA's).
* :func:`exact_match`: 1.0 when the normalized strings are equal.
* :func:`f1`: harmonic mean of token precision and recall over the normalized tokens, counting repeated
  tokens as often as both sides have them; with HotpotQA's rule that a yes/no/noanswer prediction or gold
  answer scores 0 unless both are the same.
* :func:`best_scores`: the maximum of each over every accepted gold answer.
* :func:`clean_prediction`: the first line of a generated answer, with a leading "Answer:" removed.
"""

from __future__ import annotations

import collections
import re
import string

from kvweave.tools.metrics import needle_hit

__all__ = ["normalize_answer", "exact_match", "f1", "best_scores", "clean_prediction", "needle_hit"]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = set(string.punctuation)
_SPECIAL = ("yes", "no", "noanswer")


def normalize_answer(text: str) -> str:
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    pred, ref = normalize_answer(prediction), normalize_answer(gold)
    if (pred in _SPECIAL or ref in _SPECIAL) and pred != ref:
        return 0.0
    pred_tokens, ref_tokens = pred.split(), ref.split()
    if not pred_tokens or not ref_tokens:
        return float(pred_tokens == ref_tokens)
    common = collections.Counter(pred_tokens) & collections.Counter(ref_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred_tokens), same / len(ref_tokens)
    return 2 * precision * recall / (precision + recall)


def best_scores(prediction: str, answers: tuple[str, ...] | list[str]) -> tuple[float, float]:
    """``(exact match, F1)``, each the best over ``answers``."""
    if not answers:
        raise ValueError("a QA sample needs at least one gold answer")
    return max(exact_match(prediction, a) for a in answers), max(f1(prediction, a) for a in answers)


_LEAD = re.compile(r"^\s*(the\s+)?answer\s*(is|:)\s*", re.IGNORECASE)


def clean_prediction(text: str) -> str:
    """The first non-empty line of ``text`` without a leading "Answer:" / "The answer is"."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    first = lines[0] if lines else ""
    return _LEAD.sub("", first).strip()
