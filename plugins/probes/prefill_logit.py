"""``prefill-logit``: FreqDepthKV's prefill probe, the query positions the head router evaluates Eq. (2) at.

FreqDepthKV ("FreqDepthKV: frequency-guided depth sharing for robust KV cache compression", seeds/002,
Section 3): "For a set of probe query positions P sampled from recent tokens, document boundaries, and
high-entropy attention rows, we compare original and reconstructed attention logits"; 128 positions per
prompt (Section 4).

In every forward of more than ``observe_queries`` tokens (the prefill, or a long chunk), for each layer
and batch row, ``select_queries`` picks up to ``queries`` of that forward's positions:

1. the ``recent`` share: the newest positions;
2. the ``boundaries`` share: delimiter / instruction-boundary tokens (from the token ids, like the
   ``sigmoid-multilevel`` router's flags), evenly spread over those present;
3. the rest: the rows with the highest normalized attention entropy ``H(p) / log(visible keys)`` (causal,
   averaged over the query heads), scored on up to ``candidates`` evenly spaced positions; if that is
   not enough, more recent positions.

The engine keeps the selected queries (and their positions) only until the layer's block group has been
routed in that forward, then frees them; while held they count in the cache's bytes ("observation").
During decoding the router uses the recent ``observe_queries`` queries instead. The probe measures
nothing itself (``wants`` is false): the loss is computed by the ``head-mode`` router.
"""

from __future__ import annotations

from typing import Any, ClassVar

import attrs

from kvweave.core import hookimpl
from kvweave.core.interfaces import Probe
from kvweave.core.lazy import torch
from kvweave.core.params import integer, number


def _boolean(instance: Any, attribute: attrs.Attribute, value: Any) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"'{attribute.alias}' must be true or false, got {value!r}")


def row_entropy(queries: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor, scale: float, chunk: int = 64) -> torch.Tensor:
    """Normalized causal attention entropy [B, c] of query rows ``queries`` [B, Hq, c, D] at key positions
    ``positions`` [c] (indices into ``keys`` [B, H, T, D]), averaged over the query heads."""
    batch, q_heads, count, dim = queries.shape
    heads, total = keys.shape[1], keys.shape[-2]
    per = q_heads // heads
    out = []
    key_pos = torch.arange(total, device=keys.device)
    for start in range(0, count, chunk):
        q = queries[:, :, start : start + chunk].float()
        pos = positions[start : start + chunk]
        c = q.shape[2]
        logits = q.reshape(batch, heads, per * c, dim) @ keys.float().transpose(-1, -2) * scale  # [B, H, per*c, T]
        visible = key_pos[None, :] <= pos.repeat(per)[:, None]  # [per*c, T]
        logits = logits.masked_fill(~visible, float("-inf"))
        probs = logits.softmax(-1)
        entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1)  # [B, H, per*c]
        seen = visible.sum(-1).clamp_min(2).float().log()  # log of visible keys (>= log 2)
        out.append((entropy / seen).reshape(batch, heads, per, c).mean(dim=(1, 2)))
    return torch.cat(out, -1)


@attrs.frozen
class PrefillLogitProbe(Probe):
    """Picks the probe query positions of each prefill: recent tokens, boundaries, high-entropy rows."""

    head_sharding: ClassVar[str] = (
        "the probe positions every head is routed on are chosen by attention "
        "entropy averaged over all query heads, a statistic no rank has"
    )

    needs_queries = True
    selects_queries = True

    queries: int = attrs.field(default=128, validator=integer(1, 65536), metadata={"doc": "probe positions per prompt (per layer and batch row)"})
    recent: float = attrs.field(default=0.25, validator=number(0.0, 1.0), metadata={"doc": "share of the positions taken from the newest tokens"})
    boundaries: float = attrs.field(default=0.25, validator=number(0.0, 1.0), metadata={"doc": "share taken from delimiter / boundary tokens (needs the tokenizer)"})
    candidates: int = attrs.field(default=512, validator=integer(1), metadata={"doc": "rows whose attention entropy is computed (evenly spaced)"})
    use_boundaries: bool = attrs.field(default=True, validator=_boolean, metadata={"doc": "use delimiter flags from the token ids"})

    def __attrs_post_init__(self) -> None:
        if self.recent + self.boundaries > 1.0:
            raise ValueError(f"'recent' + 'boundaries' must be <= 1 (shares of the probe positions), got {self.recent} + {self.boundaries}")

    @property
    def needs_boundaries(self) -> bool:  # type: ignore[override]
        return self.use_boundaries

    def select_queries(self, query: torch.Tensor, keys: torch.Tensor, boundary: torch.Tensor | None, scale: float | None) -> torch.Tensor:
        batch, _, new, dim = query.shape
        total = keys.shape[-2]
        count = min(self.queries, new)
        scale = scale or dim**-0.5
        stride = max(1, new // self.candidates)
        candidates = torch.arange(new - 1, -1, -stride, device=query.device).flip(0)  # always includes the newest
        entropy = row_entropy(query[:, :, candidates], keys, total - new + candidates, scale)  # [B, c]
        positions = list(range(new - 1, -1, -stride))[::-1]  # the candidates, as the host knows them
        orders = entropy.argsort(dim=-1, descending=True).tolist()  # one host read for every row
        flags: list[list[int]] = [[] for _ in range(batch)]
        flagging = self.use_boundaries and boundary is not None and self.boundaries > 0
        if flagging:
            for b, p in boundary.nonzero().tolist():  # one more
                flags[b].append(p)
        rows = []
        for b in range(batch):
            chosen: list[int] = list(range(new - round(self.recent * count), new))
            taken = set(chosen)
            if flagging:
                flagged = [p for p in flags[b] if p not in taken]
                want = min(len(flagged), round(self.boundaries * count))
                if want:
                    picks = torch.linspace(0, len(flagged) - 1, want).round().long().unique().tolist()
                    chosen += [flagged[i] for i in picks]
                    taken.update(flagged[i] for i in picks)
            for i in orders[b]:
                if len(chosen) >= count:
                    break
                position = positions[i]
                if position not in taken:
                    chosen.append(position)
                    taken.add(position)
            position = new - 1
            while len(chosen) < count:  # not enough candidates: more recent positions
                if position not in taken:
                    chosen.append(position)
                    taken.add(position)
                position -= 1
            rows.append(sorted(chosen[:count]))
        return torch.tensor(rows, dtype=torch.long, device=query.device)


@hookimpl
def kvweave_register_probes(registrar) -> None:
    registrar.add("prefill-logit", PrefillLogitProbe)
