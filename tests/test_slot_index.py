"""The stored slots' cache indices (engine/slot_index.py): two forms, the same positions, the fewer bytes.

Properties that could fail: bits decode to exactly the positions flushes wrote (kept indices in order, fillers
after, several flushes, a batch reordered, past 32,767 tokens); the form kept is the smaller one and the cache's
byte count is that form's; an input the bits cannot hold stays listed; and a KVzip cache reading its slots from
bits decodes the same tokens as one forced to list them."""

from __future__ import annotations

import pytest
import torch

from kvweave.core.registry import load_registry
from kvweave.engine import build_cache, cache_kwargs, importance
from kvweave.engine.slot_index import FLUSH_RECORD_BYTES, SlotIndex, pack_bits, position_dtype, unpack_bits

from conftest import tiny_llama, write_registry
from test_kvzip import PIPELINES, TOK, context_ids, sharpened


def flushed(batch: int, heads: int, start: int, count: int, share: float, generator: torch.Generator) -> torch.Tensor:
    """What an evicting flush stores: each row's kept cache indices in order, then -1 up to the largest count."""
    keep = torch.rand(batch, heads, count, generator=generator) < share
    slots = int(keep.sum(-1).max())
    order = ((~keep).long() * count + torch.arange(count)).argsort(dim=-1)[..., :slots]
    return torch.where(keep.gather(-1, order), order + start, -1)


def test_bits_round_trip():
    mask = torch.rand(3, 2, 37, generator=torch.Generator().manual_seed(0)) < 0.5
    packed = pack_bits(mask)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 5)
    assert torch.equal(unpack_bits(packed, 37), mask)


@pytest.mark.parametrize("origin", [0, 13, 40_000])
def test_several_flushes_decode_to_what_they_wrote_in_the_smaller_form(origin):
    generator = torch.Generator().manual_seed(origin)
    index, written, start = SlotIndex(), [], origin
    for count, share in ((20, 0.9), (64, 0.7), (64, 1.0), (7, 0.5), (128, 0.85)):
        new = flushed(2, 3, start, count, share, generator)
        index.append(new, start, count)
        written.append(new)
        start += count
        expected = torch.cat(written, dim=-1)
        assert torch.equal(index.positions.long(), expected)
        assert index.positions.dtype == position_dtype(start)
        listed_bytes = expected.numel() * torch.tensor([], dtype=position_dtype(start)).element_size()
        bits_bytes = 2 * 3 * -(-index.tokens // 8) + FLUSH_RECORD_BYTES * len(index.flush_tokens)
        assert (index.bits is not None) == (bits_bytes < listed_bytes)
        stored = sum(t.nbytes for t in index.stored()) + index.record_bytes()
        assert stored == min(bits_bytes, listed_bytes)
    assert index.bits is not None  # 70-100 % kept: bits are the smaller form here
    index.select_rows(torch.tensor([1, 0, 1]))
    assert torch.equal(index.positions.long(), expected[[1, 0, 1]])


def test_a_few_kept_tokens_stay_listed_and_a_replaced_selection_decodes():
    index = SlotIndex()
    sinks = torch.tensor([0, 1, 2, 3]).expand(1, 2, 4)
    index.append(sinks, 0, 400)
    assert index.bits is None and index.positions.tolist() == [[[0, 1, 2, 3]] * 2]
    chosen = torch.tensor([[[0, 5, 6, 9, 10, 11, 12, 30, 31, -1], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]]])
    index.replace(chosen, 32)
    assert index.bits is not None and torch.equal(index.positions.long(), chosen)
    assert index.flush_tokens == [32] and index.flush_slots == [10]


def test_what_the_bits_cannot_hold_stays_listed_and_a_gap_is_refused():
    index = SlotIndex()
    unordered = torch.tensor([[[5, 3, 4, 1, 2, 0, 7, 6]]])  # out of order: the bits would sort them
    index.append(unordered, 0, 8)
    assert index.bits is None and torch.equal(index.positions.long(), unordered)
    with pytest.raises(ValueError, match="does not follow"):
        index.append(torch.tensor([[[20]]]), 20, 4)


def test_a_kvzip_cache_reads_its_slots_from_bits_as_from_a_list(tmp_path, monkeypatch):
    """Same scored prefill, same decode (past a flush after the prefill): the cache whose slots are bits gives the
    logits of one forced to list them, and stores fewer bytes by exactly the difference of the two forms."""
    registry = load_registry(write_registry(tmp_path, "kvzip", PIPELINES))
    model = sharpened()
    ids = context_ids()

    def run() -> tuple[torch.Tensor, dict[str, int], list]:
        cache = build_cache(registry.resolve("t-kz"), model, tokenizer=TOK)
        importance.prefill(model, cache, ids[:, :-1])
        token, logits = ids[:, -1:], []
        with torch.inference_mode():
            for _ in range(24):  # 16-token blocks: the window flushes again
                out = model(input_ids=token, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1:]
                logits.append(out)
                token = out.argmax(-1)
        return torch.cat(logits, 1), cache.memory_breakdown(), list(cache.engine.windows)

    bits_logits, bits_bytes, windows = run()
    assert all(len(w.slot_index.flush_tokens) > 1 and w.slot_index.bits is not None for w in windows)
    monkeypatch.setattr(SlotIndex, "_store", lambda self, positions: setattr(self, "listed", positions) or setattr(self, "bits", None))
    listed_logits, listed_bytes, listed_windows = run()
    assert all(w.slot_index.bits is None for w in listed_windows)
    assert torch.equal(bits_logits, listed_logits)
    for a, b in zip(windows, listed_windows):
        assert torch.equal(a.positions, b.positions)
    saved = sum(sum(t.nbytes for t in b.slot_index.stored()) - sum(t.nbytes for t in a.slot_index.stored()) - a.slot_index.record_bytes()
                for a, b in zip(windows, listed_windows))
    assert saved > 0 and listed_bytes["eviction"] - bits_bytes["eviction"] == saved
    assert {k: v for k, v in bits_bytes.items() if k != "eviction"} == {k: v for k, v in listed_bytes.items() if k != "eviction"}


def test_a_kernel_reading_the_storage_in_place_keeps_the_list():
    """The lowbit kernel takes the slots' indices every decode step: its engine keeps them listed, the reference
    path's engine keeps bits where they are smaller."""
    index = SlotIndex(bits=False)
    index.append(torch.arange(60).expand(1, 2, 60), 0, 64)
    assert index.bits is None and index.listed is not None
    model = tiny_llama(torch.float32, layers=2, hidden=256)
    for name, bits in (("prerope-qa35v3-lowbit", False), ("prerope-qa35v3", True)):
        cache = build_cache(load_registry().resolve(name), model)
        assert all(w.slot_index.allow_bits is bits for w in cache.engine.windows), name
