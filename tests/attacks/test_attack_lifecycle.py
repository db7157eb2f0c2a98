"""A runtime whose disk died still closes everything, once; pins pair with unpins.

Before: `KVTier.close()` after the disk died raised a bare `OSError` from the first part that
failed and left the remaining tiers open; `pin()` skipped keys that were not stored and returned a
count, while `unpin()` of those keys raised, so a caller could not pair them. Cost: about 1 s.
"""

from __future__ import annotations

import os

import pytest

from kvtier.errors import KVTierError, TierIOError
from kvtier.tiers.base import TierKind
from support.persistence import KEYS, fill, persistent
from support.runtime import runtime, store

D, S = TierKind.DRAM, TierKind.SSD


def _record_closes(kv) -> list[TierKind]:
    closed: list[TierKind] = []
    for kind, tier in kv.tiers.items():
        inner = tier.close

        def close(kind=kind, inner=inner):
            closed.append(kind)
            inner()

        tier.close = close
    return closed


def test_close_after_the_disk_died_closes_every_tier_and_reports_once(tmp_path):
    kv = persistent(tmp_path)
    fill(kv, KEYS[:3])
    closed = _record_closes(kv)
    os.close(kv.tiers[S]._journal._fd)  # the journal's disk is gone: its fsync and close fail (EBADF)
    ssd = kv.tiers[S]
    for fd in list(getattr(ssd, "_fds", [])):  # and so are the slab files
        os.close(fd)
    with pytest.raises(TierIOError, match="SSD journal") as info:
        kv.close()
    assert isinstance(info.value, KVTierError)
    assert "everything else was closed" in str(info.value)
    assert sorted(closed) == sorted(kv.tiers), "every tier was closed despite the failures"
    kv.close()  # idempotent: reported once, not again


def test_close_of_a_healthy_runtime_raises_nothing(tmp_path):
    with runtime(tmp_path) as kv:
        store(kv, [1, 2])
        closed = _record_closes(kv)
    assert sorted(closed) == sorted(kv.tiers)


def test_pin_says_which_keys_it_pinned_and_unpin_of_the_same_keys_pairs_with_it(tmp_path):
    with runtime(tmp_path) as kv:
        store(kv, [1, 2])
        asked = [1, 7, 2, 8]  # 7 and 8 are not stored
        pinned = kv.pin(asked)
        assert pinned == [1, 2]
        assert kv.unpin(asked) == [1, 2], "the same keys: what was pinned is unpinned, the rest skipped"
        assert kv.unpin(asked) == [], "no pin is left to undo"
        twice = kv.pin([1]) + kv.pin([1])
        assert kv.unpin(twice) == [1, 1], "pins count"
