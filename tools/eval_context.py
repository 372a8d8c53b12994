"""What a ``kvweave eval`` task works with: :class:`Evaluation` (the model, its tokenizer, the pipelines
and the run folder; builds caches, answers prompts greedily, runs the cells not yet in the folder with a
progress bar), the model's label, and the essay text ``ppl``, ``fidelity`` and ``speed`` feed.

Query-agnostic answering (:meth:`Evaluation.encode_split`, ``answer(..., context_tokens=n)``): the cache
compresses tokens after the forward pass that added them, so a prompt prefilled in one forward is
answered with an exact view of all of it, question included. Split instead, the context part is
prefilled (and compressed) on its own, then ``generate`` feeds the question part, which every layer
attends to exactly before the first answer token, over what the cache kept of the context.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from kvweave.core.errors import KvweaveError
from kvweave.core.registry import Registry, ResolvedPipeline
from kvweave.engine import importance
from kvweave.engine.generation import generate
from kvweave.engine.pipeline import build_cache
from kvweave.tools import metrics
from kvweave.tools.data import essays_text, leading_token_ids
from kvweave.tools.eval_folder import EvalError, RunFolder, key

PPL_OFFSET = 2_600_000  # characters into the essays: text the needle haystacks never use


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
        """A fresh cache of pipeline ``name`` (resolved already by :meth:`pipeline`) bound to the model."""
        return build_cache(self._resolved[name], self.model, tokenizer=self.tokenizer)

    def say(self, message: str) -> None:
        if self.progress:
            from tqdm.auto import tqdm

            tqdm.write(message, file=sys.stderr)

    def bar(self, total: int, done: int, desc: str) -> Any:
        from tqdm.auto import tqdm

        return tqdm(total=total, initial=done, desc=desc, unit="cell", file=sys.stderr, disable=not self.progress, dynamic_ncols=True)

    def encode_prompt(self, text: str) -> dict[str, torch.Tensor]:
        """``text`` as the model's user turn (chat template, when used) -> ``input_ids``/``attention_mask`` [1, T]."""
        return self.tokenizer(self.templated(text), add_special_tokens=not self.chat, return_tensors="pt")

    def templated(self, text: str) -> str:
        """``text`` as the model's user turn with the generation prompt (the chat template), or as is."""
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
        return text

    def encode_split(self, context: str, question: str) -> tuple[dict[str, torch.Tensor], int]:
        """The prompt ``context + question`` as :meth:`encode_prompt` encodes it, and ``n``: its first ``n``
        ids are the context part (the chat template's prefix, ``context``), the rest the question part
        (``question``, the end of the user turn, the generation prompt). Tokenizing the two parts of the
        templated text apart gives the prompt's ids where no token spans the split (checked); where one
        does, ``n`` is where the context part's ids stop matching the prompt's, so the ids are always the
        whole prompt's and the question part holds every token of ``question``."""
        full = self.templated(context + question)
        at = full.rfind(question)
        if not question or at < 0:
            raise EvalError("the chat template changed the question's text; the prompt cannot be split (use --query-aware)")
        inputs = self.tokenizer(full, add_special_tokens=not self.chat, return_tensors="pt")
        ids = inputs["input_ids"][0].tolist()
        head = self.tokenizer(full[:at], add_special_tokens=not self.chat)["input_ids"]
        tail = self.tokenizer(full[at:], add_special_tokens=False)["input_ids"]
        if head + tail == ids:
            split = len(head)
        else:  # a token spans the split (or the tokenizer marks a text's start): cut where the ids agree
            split = next((i for i, (a, b) in enumerate(zip(head, ids)) if a != b), min(len(head), len(ids)))
        if not 0 < split < len(ids):
            raise EvalError(f"the prompt's context part takes {split} of its {len(ids)} tokens; nothing to split")
        return inputs, split

    def answer(self, name: str, inputs: dict[str, torch.Tensor], max_new_tokens: int | None = None,
               context_tokens: int = 0, cuda_graphs: bool = False) -> tuple[str, Any]:
        """Greedy answer of pipeline ``name`` to ``inputs`` (``input_ids`` [1, T], ...); returns the text and
        the generation stats (:class:`kvweave.engine.generation` ``generate``'s). With ``context_tokens``
        (query-agnostic), the first ``context_tokens`` ids are prefilled into the cache in a forward of
        their own, then generation feeds the rest (its stats time that part only). ``cuda_graphs``: the decode steps from
        CUDA graphs (:mod:`kvweave.engine.graphs`)."""
        torch.manual_seed(self.seed)
        cache = self.cache(name)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        total = inputs["input_ids"].shape[-1]
        if not 0 <= context_tokens < total:
            raise EvalError(f"context_tokens {context_tokens} is outside 0..{total - 1} for a {total}-token prompt")
        if context_tokens:
            self.prefill(cache, inputs["input_ids"][:, :context_tokens])
        new, stats = generate(self.model, inputs, cache, max_new_tokens=max_new_tokens or self.max_new_tokens, do_sample=False,
                              temperature=None, top_p=None, top_k=None, pad_token_id=self.tokenizer.pad_token_id,
                              cuda_graphs=cuda_graphs)
        fed = total + new.shape[-1] - 1  # the last new token is never fed
        if context_tokens and cache.get_seq_length() != fed:
            raise EvalError(f"generate left {cache.get_seq_length()} tokens in a cache prefilled with {context_tokens} of a "
                            f"{total}-token prompt (expected {fed}): it did not continue from the prefilled cache")
        return self.tokenizer.decode(new[0], skip_special_tokens=True), stats

    def prefill(self, cache: Any, input_ids: torch.Tensor) -> None:
        """One forward of ``input_ids`` [1, n] into ``cache`` (which compresses what its pipeline packs), the context
        scored first for a pipeline whose evictor chooses by context importance, and then stored from the scoring's own
        pass as ``kvweave generate`` stores it (``kvweave.engine.ingest``: the forward feeds the last token only)."""
        importance.prefill(self.model, cache, input_ids, ingest=True)

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


def model_label(model: Any) -> str:
    """What the plots and tables call the model: the name kvweave loaded it under (see ``cmd_eval``)."""
    label = getattr(model, "_kvweave_label", None)
    if label:
        return label
    return str(getattr(model.config, "_name_or_path", "") or getattr(model.config, "model_type", "model")).rstrip("/").split("/")[-1]


def essay_ids(ev: Evaluation, tokens: int) -> torch.Tensor:
    """``tokens`` ids [1, T] of the essays from character ``PPL_OFFSET`` on (a sentence start)."""
    text = essays_text()
    start = PPL_OFFSET + next((b for b in metrics.sentence_boundaries(text[PPL_OFFSET : PPL_OFFSET + 5000]) if b > 0), 0)
    ids = leading_token_ids(ev.tokenizer, text[start:], tokens)
    if len(ids) < tokens:
        raise EvalError(f"the essays hold only {len(ids)} tokens after character {PPL_OFFSET}, fewer than --tokens {tokens}")
    return torch.tensor([ids])
