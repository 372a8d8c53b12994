"""The dense kernel's splits with a shorter last wave (:func:`dense_tail`), where the launch chooses them
(:func:`kvweave.kernels.lowbit_decode.plan_launch`)."""

from __future__ import annotations

import functools

from kvweave.core.environment import env_setting

#: where the dense kernel's programs are more than one wave, the splits of each row that make up its last wave's worth
#: of programs (the last ones launched) run this share of the others' length, in percent (0: every split alike): the
#: programs of a pass vary in length (each SM's share of the bandwidth), so its last ones end unevenly, and for up to a
#: sixth of a call fewer than 90% of the slots ran (H100, 2026-12-07: docs/kernels.md "Where a call's time goes among
#: its programs"); shorter last programs leave a shorter tail. 33 took 1-8% off every call of more than one wave
#: timed (H100), 25 as much, 50 / 67 less (docs/kernels.md "The last wave of splits shorter, timed").
#: KVWEAVE_DENSE_TAIL sets it
DENSE_TAIL = env_setting("KVWEAVE_DENSE_TAIL", 33, (0, 25, 33, 50, 67))


def dense_tail(rows: int, groups: int, splits: int, slots: int, percent: int | None = None) -> tuple[int, int, int, int]:
    """Each of ``rows`` rows' ``groups`` token groups in about ``splits`` splits for ``slots`` programs at once:
    (splits, the long splits' length in groups, how many splits are long, the short ones' length), the short splits
    last; with ``percent`` (None: :data:`DENSE_TAIL`) the last wave's worth of programs (``slots / rows`` splits a row)
    that share of the long ones' length, else every split alike (as where the programs are one wave). Every split
    holds at least one group and together they hold each group once."""
    return _tail_splits(rows, groups, splits, slots, DENSE_TAIL if percent is None else percent)


@functools.lru_cache(maxsize=256)
def _tail_splits(rows: int, groups: int, splits: int, slots: int, percent: int) -> tuple[int, int, int, int]:
    """:func:`dense_tail` for a given ``percent``, kept per shape: every decode step of a layer asks the same."""
    uniform = -(-groups // max(1, splits))
    if not percent or rows * splits <= slots or splits < 2:
        return -(-groups // uniform), uniform, -(-groups // uniform), uniform
    short = min(splits - 1, -(-slots // rows))
    long = splits - short
    length = 1
    while long * length + short * max(1, length * percent // 100) < groups:
        length += 1
    if long * length >= groups:  # no room left for short splits
        return -(-groups // length), length, -(-groups // length), length
    brief = max(1, length * percent // 100)
    return long + -(-(groups - long * length) // brief), length, long, brief
