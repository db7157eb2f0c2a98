"""The block index's storage: columns and ids, nothing per block that the garbage collector tracks.

Counted, never timed: the pause a full collection costs at 1M and 10M blocks is measured in
bench/bench_manager.py (`--memory`); here the number of tracked objects a manager holds must not
grow with the blocks it indexes, for every policy, and the index's bookkeeping (ids reused, columns
grown in place, keys kept compact in the key table, others beside them) must stay consistent.
"""

from __future__ import annotations

import gc

import pytest
import xxhash

from kvtier.errors import KVTierError
from kvtier.deciding.index import BlockIndex
from kvtier.kinds import TierKind
from kvtier.deciding.manager import TierManager, TierSlots
from kvtier.policy import PolicyKind, make_policy

D, S = TierKind.DRAM, TierKind.SSD


def digests(start: int, count: int) -> list[bytes]:
    return [xxhash.xxh3_128_digest(i.to_bytes(8, "little")) for i in range(start, start + count)]


def two_tiers(policy: PolicyKind, dram: int, ssd: int) -> TierManager:
    return TierManager([TierSlots(D, dram, make_policy(policy, dram)), TierSlots(S, ssd, make_policy(policy, ssd))])


def tracked_objects() -> int:
    gc.collect()
    return len(gc.get_objects())


@pytest.mark.parametrize("policy", list(PolicyKind), ids=lambda k: k.value)
def test_indexing_many_blocks_adds_no_object_per_block_that_the_collector_tracks(policy):
    m = two_tiers(policy, 1_000, 6_000)
    m.store_now(digests(0, 50))  # first-use allocations (ids, columns, policy queues) out of the count
    keys = digests(50, 5_000)
    before = tracked_objects()
    for i in range(0, len(keys), 50):
        m.store_now(keys[i:i + 50])
        m.load_now(keys[i // 2:i // 2 + 10])  # promotions and touches too
    after = tracked_objects()
    assert len(m.index) == 5_050 and m.num_used(D) + m.num_used(S) == 5_050
    assert after - before < 50, f"{after - before} more tracked objects for 5,000 more blocks"
    assert gc.get_referents(m.index.ids) == [], "the key -> id table must hold no object per key"


def test_ids_are_reused_and_never_outnumber_the_slots():
    m = two_tiers(PolicyKind.LRU, 100, 400)
    for i in range(0, 20_000, 100):  # 40 times the slots: blocks dropped from the SSD all along
        m.store_now(digests(i, 100))
    index = m.index
    assert len(index) == m.num_used(D) + m.num_used(S) >= 400
    assert index._next_id <= index.capacity == 500
    assert sum(m.stats.dropped.values()) == 20_000 - len(index)
    for entry in index:  # every indexed block's columns agree with the tiers' owners
        (tier, copy), = entry.copies.items()
        assert m.owner(tier, copy.slot) == entry.key and m.where(entry.key) is tier


def test_columns_grow_in_place_past_their_first_allocation():
    m = two_tiers(PolicyKind.LRU, 3_000, 3_000)  # 6,000 ids: several growths of the per-id columns
    keys = digests(0, 6_000)
    for i in range(0, 6_000, 100):
        m.store_now(keys[i:i + 100])
    assert m.lookup(keys) == 6_000 and m.index._allocated >= 6_000
    for tier in (D, S):
        held = [m.owner(tier, slot) for slot in range(3_000)]
        assert sorted(held) == sorted(k for k in keys if m.where(k) is tier), f"{tier.name}: owners and index disagree"
    assert m.index.get(keys[0]).key == keys[0]


def test_keys_other_than_digests_and_ints_are_kept_too_and_come_back_unchanged():
    m = two_tiers(PolicyKind.LRU, 4, 16)
    first = digests(0, 6)
    m.store_now(first)
    strangers = [7, "eight", b"short", (9, 10)]
    m.store_now(strangers)  # a simulation's ints, anything hashable: kept on the side of the table
    assert m.index.ids.mode == "digest" and m.index.ids.num_side == len(strangers)
    for key in [*first, *strangers]:
        assert m.lookup([key]) == 1 and m.index.get(key).key == key
    owners = {m.owner(t, s) for t in (D, S) for s in range(m.num_slots(t))} - {None}
    assert owners == {*first, *strangers}


@pytest.mark.parametrize("stranger", [2**63, -(2**63) - 1, "nine", b"x" * 16, 9.5],
                         ids=["past int64", "below int64", "str", "digest", "float"])
def test_int_keys_are_compact_and_a_key_of_another_kind_is_kept_beside_them(stranger):
    """A simulation's hash ids (ints) are what the table part holds; a key it does not take is kept
    on the side, and every key comes back as it was stored."""
    m = two_tiers(PolicyKind.LRU, 4, 16)
    ints = [0, -5, 2**63 - 1, -(2**63), 12345678901234]
    m.store_now(ints)
    index = m.index
    assert index.ids.mode == "int" and index.ids.num_side == 0 and index.key_of(index.ids[-5]) == -5
    m.store_now([stranger])
    assert index.ids.num_side == 1
    for key in [*ints, stranger]:
        assert m.lookup([key]) == 1
        assert type(index.get(key).key) is type(key) and index.get(key).key == key
    owners = [m.owner(t, s) for t in (D, S) for s in range(m.num_slots(t))]
    assert sorted(map(repr, filter(lambda k: k is not None, owners))) == sorted(map(repr, [*ints, stranger]))


def test_int_keys_reuse_ids_past_the_first_allocation():
    m = two_tiers(PolicyKind.LRU, 500, 2_000)
    for i in range(0, 20_000, 100):  # past the first allocation of ids, and dropping from the SSD
        m.store_now(list(range(i, i + 100)))
    index = m.index
    held = len(index)
    assert index.ids.mode == "int" and held == m.num_used(D) + m.num_used(S) and index._next_id <= 2_500
    assert all(index.key_of(block) == key for key, block in index.ids.items())
    assert sum(m.lookup([key]) for key in range(20_000)) == held
    assert m.lookup(range(19_900, 20_000)) == 100  # the last request is all there


def test_an_index_refuses_more_ids_than_slots():
    index = BlockIndex({D: 2})
    index.add(b"a" * 16)
    index.add(b"b" * 16)
    with pytest.raises(KVTierError, match="index is full"):
        index.add(b"c" * 16)


def test_bench_manager_memory_mode_reports_every_figure(tmp_path):
    """`bench/bench_manager.py --memory` runs its child and writes what it measured (values not judged)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "bench" / "bench_manager.py"
    out = tmp_path / "memory.json"
    done = subprocess.run([sys.executable, str(script), "--memory", "3000", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (row,) = json.loads(out.read_text())["memory"]
    assert row["blocks"] == row["indexed"] == 3000 and row["lookups_found"] == 1000
    assert row["tracked_objects"] < 200 and not row["torch_imported"]
    for field in ("gc_pause_ms", "lookup_touch_us", "store_us", "fill_blocks_per_s"):
        assert row[field] > 0, field
    assert isinstance(row["rss_per_block"], float)  # 3,000 blocks may fit in memory the process had
