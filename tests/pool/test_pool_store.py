"""The pool node's block store without sockets: allocation, recency eviction, leases on a fake clock,
quotas, isolation, bounds and generations. Cost: well under a second.
"""

from __future__ import annotations

import pytest

from kvtier.pool.protocol import ErrorCode, GrantStatus
from kvtier.pool.node.store import AccessError, BlockStore

KIB = 1024
REGION = 64 * KIB
BLOCK = 16 * KIB  # 4 blocks per region


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_store(clock: Clock, regions: int = 2, quotas: dict[str, int] | None = None) -> BlockStore:
    return BlockStore(regions * REGION, REGION, quotas or {"a": regions * REGION, "b": regions * REGION}, clock)


def put(store: BlockStore, key: bytes, tenant: str = "a", length: int = BLOCK) -> GrantStatus:
    """A whole put: begin, write every byte, commit."""
    g = store.put_begin(tenant, key, length, lease_s=30)
    if g.block is None:
        return g.status
    access = store.begin_access(tenant, g.block.region.id, g.block.offset, length, g.block.gen, write=True)
    store.end_access(access, ok=True)
    assert store.commit(tenant, key, g.block.gen, checksum=123)
    return g.status


def read_lease(store: BlockStore, key: bytes, tenant: str = "a", lease_s: float = 30):
    (g,) = store.get(tenant, [key], lease_s)
    return g


def test_put_get_and_exists(clock) -> None:
    store = make_store(clock)
    assert put(store, b"k") is GrantStatus.GRANTED
    assert store.put_begin("a", b"k", BLOCK, 1).status is GrantStatus.EXISTS
    g = read_lease(store, b"k")
    assert (g.block.length, g.block.checksum) == (BLOCK, 123)
    assert store.get("a", [b"missing"], 1) == [None]
    assert store.counters["hits"] == 1 and store.counters["misses"] == 1


def test_writing_blocks_are_invisible_and_commit_needs_every_byte(clock) -> None:
    store = make_store(clock)
    g = store.put_begin("a", b"k", BLOCK, 30)
    assert store.get("a", [b"k"], 1) == [None] and store.contains("a", [b"k"]) == [False]
    assert store.put_begin("a", b"k", BLOCK, 30).status is GrantStatus.BUSY
    half = store.begin_access("a", g.block.region.id, g.block.offset, BLOCK // 2, g.block.gen, write=True)
    store.end_access(half, ok=True)
    assert not store.commit("a", b"k", g.block.gen, 1)  # half written: dropped, slot freed
    assert store.stats()["used_bytes"] == 0


def test_recency_eviction_spares_recently_read_blocks(clock) -> None:
    store = make_store(clock, regions=1)
    for i in range(4):
        put(store, b"k%d" % i)
    store.release("a", [read_lease(store, b"k0").lease])  # k0 becomes the most recent
    assert put(store, b"k4") is GrantStatus.GRANTED
    assert store.contains("a", [b"k0", b"k1", b"k2", b"k3", b"k4"]) == [True, False, True, True, True]
    assert store.counters["evictions"] == 1


def test_a_leased_block_is_never_evicted_until_its_lease_expires(clock) -> None:
    store = make_store(clock, regions=1)
    put(store, b"k0")
    lease = read_lease(store, b"k0", lease_s=5)
    for i in range(1, 4):
        put(store, b"k%d" % i)
    for i in range(4, 10):  # each evicts the oldest *idle* block, never k0
        assert put(store, b"k%d" % i) is GrantStatus.GRANTED
        assert store.contains("a", [b"k0"]) == [True]
    clock.now += 5
    put(store, b"k10")  # k0's lease has expired: it is now the least recent block
    assert store.contains("a", [b"k0"]) == [False]
    assert store.counters["leases_expired"] == 1
    store.release("a", [lease.lease])  # a late release of an expired lease changes nothing


def test_full_of_leases_rejects_and_changes_nothing(clock) -> None:
    store = BlockStore(REGION, REGION, {"a": 10 * REGION}, clock)
    for i in range(4):
        put(store, b"k%d" % i)
        read_lease(store, b"k%d" % i)
    before = store.stats()
    assert store.put_begin("a", b"new", BLOCK, 30).status is GrantStatus.FULL
    assert store.stats()["used_bytes"] == before["used_bytes"] and store.counters["rejected_full"] == 1


def test_expired_lease_lets_the_slot_be_reused_and_old_locations_read_stale(clock) -> None:
    store = make_store(clock, regions=1)
    for i in range(4):
        put(store, b"k%d" % i)
    old = read_lease(store, b"k0", lease_s=0).block
    for i in range(4, 8):
        put(store, b"k%d" % i)  # every old block, k0 included (lease expired), is evicted
    reused = {(g.block.region.id, g.block.offset) for g in store.get("a", [b"k4", b"k5", b"k6", b"k7"], 1)}
    assert (old.region.id, old.offset) in reused
    with pytest.raises(AccessError) as info:
        store.begin_access("a", old.region.id, old.offset, BLOCK, old.gen, write=False)
    assert info.value.code is ErrorCode.STALE


def test_an_access_in_flight_pins_the_block_past_its_lease(clock) -> None:
    store = make_store(clock, regions=1)
    for i in range(4):
        put(store, b"k%d" % i)
    g = read_lease(store, b"k0", lease_s=0)
    access = store.begin_access("a", g.block.region.id, g.block.offset, BLOCK, g.block.gen, write=False)
    clock.now += 100
    for i in range(4, 8):
        put(store, b"k%d" % i)
    assert store.contains("a", [b"k0"]) == [True]  # the read in flight kept it
    store.end_access(access, ok=True)
    put(store, b"k8")
    assert store.contains("a", [b"k0"]) == [False]


def test_abandoned_put_is_reclaimed_when_its_write_lease_expires(clock) -> None:
    store = make_store(clock)
    store.put_begin("a", b"k", BLOCK, lease_s=2)
    clock.now += 2
    assert store.stats()["used_bytes"] == 0 and store.put_begin("a", b"k", BLOCK, 2).status is GrantStatus.GRANTED


@pytest.mark.parametrize("key", [b"k", b"0123456789abcdef"], ids=["short key", "16-byte key"])
def test_tenants_see_only_their_own_blocks_and_regions(clock, key) -> None:
    """Both kinds of key: a 16-byte one lives in the node's key table under the tenant's tag, others beside it."""
    store = make_store(clock)
    put(store, key, tenant="a")
    assert store.contains("b", [key]) == [False] and store.get("b", [key], 1) == [None]
    grant = read_lease(store, key)
    block = grant.block
    with pytest.raises(AccessError) as info:
        store.begin_access("b", block.region.id, block.offset, BLOCK, block.gen, write=False)
    assert info.value.code is ErrorCode.STALE and store.counters["forbidden"] == 1
    assert store.delete("b", [key]) == 0
    store.release("a", [grant.lease])
    assert store.put_begin("b", key, BLOCK, 1).status is GrantStatus.GRANTED  # b's own key is another block
    assert store.stats("a")["tenant"]["num_blocks"] == 1 and store.stats("b")["tenant"]["num_blocks"] == 1
    assert store.delete("a", [key]) == 1 and store.get("a", [key], 1) == [None]
    assert store.contains("b", [key]) == [False]  # b's is still WRITING, and still there
    assert store.stats("b")["tenant"]["num_blocks"] == 1


@pytest.mark.parametrize("offset,length,code", [
    (0, BLOCK + 1, ErrorCode.BOUNDS), (BLOCK - 1, 2, ErrorCode.BOUNDS), (REGION - 1, 2, ErrorCode.BOUNDS),
    (-1, 1, ErrorCode.BOUNDS), (BLOCK, 1, ErrorCode.STALE)])
def test_every_access_is_bounds_checked(clock, offset, length, code) -> None:
    store = make_store(clock)
    put(store, b"k")
    block = read_lease(store, b"k").block
    with pytest.raises(AccessError) as info:
        store.begin_access("a", block.region.id, block.offset + offset, length, block.gen, write=False)
    assert info.value.code is code
    with pytest.raises(AccessError):
        store.begin_access("a", 99, 0, 1, block.gen, write=False)


def test_committed_blocks_are_immutable_and_mutable_ones_are_not(clock) -> None:
    store = make_store(clock)
    put(store, b"k")
    block = read_lease(store, b"k").block
    with pytest.raises(AccessError, match="committed"):
        store.begin_access("a", block.region.id, block.offset, 1, block.gen, write=True)
    slot = store.alloc("a", b"slot", 100).block
    store.end_access(store.begin_access("a", slot.region.id, slot.offset + 10, 90, slot.gen, write=True), True)
    assert store.alloc("a", b"slot", 100).block == slot  # the same key again: the same block (handles compare by id and generation)
    assert store.get("a", [b"slot"], 1) == [None]  # mutable blocks are not keyed content


def test_quota_evicts_the_tenants_own_blocks_first_then_refuses(clock) -> None:
    store = make_store(clock, regions=4, quotas={"a": 3 * BLOCK, "b": 4 * REGION})
    put(store, b"b0", tenant="b")
    for i in range(5):
        assert put(store, b"a%d" % i) is GrantStatus.GRANTED
    assert store.stats("a")["tenant"]["used_bytes"] == 3 * BLOCK
    assert store.contains("a", [b"a0", b"a1", b"a2", b"a3", b"a4"]) == [False, False, True, True, True]
    assert store.contains("b", [b"b0"]) == [True]
    for key in (b"a2", b"a3", b"a4"):
        read_lease(store, key)
    assert store.put_begin("a", b"a5", BLOCK, 30).status is GrantStatus.QUOTA


def test_a_full_node_reclaims_the_least_recent_region_of_another_class_or_tenant(clock) -> None:
    store = make_store(clock, regions=2)
    put(store, b"small", tenant="b", length=4 * KIB)  # b's region of 4 KiB slots
    for i in range(4):
        put(store, b"a%d" % i)  # a's region of 16 KiB slots: the node is now out of regions
    read_lease(store, b"a0")
    assert put(store, b"a4") is GrantStatus.GRANTED  # b's region is the least recent: reclaimed
    assert store.contains("b", [b"small"]) == [False]
    assert store.contains("a", [b"a0", b"a1", b"a2", b"a3", b"a4"]) == [True] * 5


def test_too_large_and_generations_are_unique(clock) -> None:
    store = make_store(clock)
    assert store.put_begin("a", b"big", REGION + 1, 1).status is GrantStatus.TOO_LARGE
    gens = set()
    for i in range(20):
        put(store, b"k%d" % i)
        gens.add(read_lease(store, b"k%d" % i, lease_s=0).block.gen)
    assert len(gens) == 20


# ---- no tenant reads bytes it did not write (issue 9, item 1) -------------------------------

class Scrubs(list):
    """A `Scrub` that records its calls: (region id, start, length, hand_over)."""

    def __call__(self, region, start: int, length: int, hand_over: bool) -> int:
        self.append((region.id, start, length, hand_over))
        return length


def scrubbing_store(clock: Clock, regions: int = 1, **kw) -> tuple[BlockStore, Scrubs]:
    scrubs = Scrubs()
    return BlockStore(regions * REGION, REGION, {"a": regions * REGION, "b": regions * REGION}, clock,
                      scrub=scrubs, **kw), scrubs


def test_a_region_passing_to_another_tenant_is_zeroed_over_what_was_allocated(clock) -> None:
    store, scrubs = scrubbing_store(clock)
    put(store, b"k0")
    put(store, b"k1")
    assert store.delete("a", [b"k0", b"k1"]) == 2  # the region is free, and holds a's bytes
    put(store, b"k2")
    assert scrubs == [], "back to its last tenant: nothing to hide"
    store.delete("a", [b"k2"])
    assert put(store, b"b0", tenant="b") is GrantStatus.GRANTED
    assert scrubs == [(0, 0, 2 * BLOCK, True)], "only the extent ever allocated is zeroed"
    assert store.counters["scrubbed_bytes"] == 2 * BLOCK and store.counters["region_handovers"] == 1


def test_an_idle_region_evicted_for_another_tenant_is_zeroed_before_it_is_handed_over(clock) -> None:
    store, scrubs = scrubbing_store(clock)
    for i in range(4):
        put(store, b"a%d" % i)
    assert store.alloc("b", b"slot", BLOCK).status is GrantStatus.GRANTED  # evicts a's whole region
    assert store.contains("a", [b"a0"]) == [False]
    assert scrubs[0] == (0, 0, REGION, True)


def test_a_mutable_block_is_zeroed_when_its_slot_held_bytes_before(clock) -> None:
    store, scrubs = scrubbing_store(clock)
    put(store, b"k")
    store.delete("a", [b"k"])
    slot = store.alloc("a", b"slot", BLOCK - 10).block  # readable at once: the old bytes must not show
    assert scrubs == [(0, 0, BLOCK - 10, False)]
    assert store.alloc("a", b"fresh", BLOCK).block.offset == BLOCK and len(scrubs) == 1, "a never-used slot"
    assert store.alloc("a", b"slot", BLOCK - 10).block == slot and len(scrubs) == 1, "the same block: not again"


def write(store: BlockStore, grant, start: int, length: int) -> None:
    b = grant.block
    store.end_access(store.begin_access("a", b.region.id, b.offset + start, length, b.gen, write=True), ok=True)


def test_a_commit_needs_writes_that_covered_every_byte_not_a_byte_count(clock) -> None:
    store = make_store(clock)
    g = store.put_begin("a", b"k", BLOCK, 30)
    for _ in range(4):
        write(store, g, 0, BLOCK // 4)  # as many bytes as the block, all in its first quarter
    assert not store.commit("a", b"k", g.block.gen, 1) and store.get("a", [b"k"], 1) == [None]
    g = store.put_begin("a", b"k", BLOCK, 30)
    for quarter in (3, 1, 0, 2):  # out of order, overlapping the next by a byte
        write(store, g, quarter * BLOCK // 4, min(BLOCK // 4 + 1, BLOCK - quarter * BLOCK // 4))
    assert store.commit("a", b"k", g.block.gen, 1) and store.get("a", [b"k"], 1)[0] is not None


def test_coverage_remembers_a_bounded_number_of_ranges_and_never_more_than_was_written(clock) -> None:
    store = make_store(clock)
    g = store.put_begin("a", b"k", BLOCK, 30)
    for i in range(1, BLOCK // 2):  # every other byte past the first: thousands of islands
        write(store, g, 2 * i, 1)
    assert len(g.block.islands) <= 32
    write(store, g, 0, BLOCK - 1)
    assert not store.commit("a", b"k", g.block.gen, 1), "the last byte was never written"


# ---- leases are bounded (issue 9, item 6) ----------------------------------------------------

def test_leases_are_bounded_per_connection_and_per_tenant_and_a_refusal_leases_nothing(clock) -> None:
    store = BlockStore(2 * REGION, REGION, {"a": 2 * REGION, "b": 2 * REGION}, clock,
                       max_leases_per_owner=3, max_leases_per_tenant=5)
    for i in range(4):
        put(store, b"k%d" % i)
    put(store, b"b", tenant="b")
    assert all(store.get("a", [b"k0", b"k1", b"k2"], 30, owner="c1"))
    with pytest.raises(AccessError) as info:
        store.get("a", [b"k3"], 30, owner="c1")
    assert info.value.code is ErrorCode.LIMIT and store.stats("a")["tenant"]["active_leases"] == 3
    assert all(store.get("a", [b"k3", b"k3"], 30, owner="c2"))  # another connection: the tenant's bound
    with pytest.raises(AccessError):
        store.get("a", [b"k0"], 30, owner="c3")
    assert store.put_begin("a", b"new", BLOCK, 30, owner="c3").status is GrantStatus.LIMIT
    assert all(store.get("b", [b"b"] * 3, 30, owner="c4")), "another tenant is unaffected"
    assert store.counters["rejected_limit"] == 3


def test_a_closed_connection_leaves_no_lease_and_no_abandoned_put_behind(clock) -> None:
    store = make_store(clock)
    put(store, b"k")
    store.get("a", [b"k"] * 100, 30, owner="c1")
    g = store.put_begin("a", b"half", BLOCK, 30, owner="c1")
    write(store, g, 0, BLOCK // 2)
    store.get("a", [b"k"], 30, owner="c2")
    store.disconnect("c1")
    assert store.stats()["active_leases"] == 1 and store.counters["leases_dropped_on_close"] == 101
    assert store.put_begin("a", b"half", BLOCK, 30).status is GrantStatus.GRANTED, "the abandoned put is gone"


def test_released_leases_give_their_memory_back_before_they_would_have_expired(clock) -> None:
    store = make_store(clock)
    put(store, b"k")
    grants = store.get("a", [b"k"] * 4096, 60, owner="c1") + store.get("a", [b"k"] * 4096, 60, owner="c1")
    store.release("a", [g.lease for g in grants[:4096]])
    assert store.stats()["active_leases"] == 4096
    store.disconnect("c1")
    facts = store.stats()
    assert facts["active_leases"] == 0 and facts["lease_heap_entries"] <= 1024 < 8192


def test_holding_many_blocks_adds_no_object_per_block_that_the_collector_tracks(clock) -> None:
    """The node's index is columns (see kvtier.pool.node.blocks): thousands of blocks, reads, leases
    and evictions leave the number of objects the garbage collector tracks where it was."""
    import gc

    store = make_store(clock, regions=400, quotas={"a": 200 * REGION, "b": 200 * REGION})  # 800 blocks each
    digest = lambda name: name.ljust(16, b"_")  # 16 bytes, as a client's block keys are  # noqa: E731
    for i in range(20):
        put(store, digest(b"warm%d" % i))
    gc.collect()
    before = len(gc.get_objects())
    for i in range(3000):  # past "a"'s quota: its least recently used blocks are evicted all along
        put(store, digest(b"k%d" % i))
        if i % 3 == 2:  # a read of a recent block, its lease released
            store.release("a", [read_lease(store, digest(b"k%d" % (i - 1))).lease])
    put(store, digest(b"k2999"), tenant="b")  # the same key, another tenant: another block
    gc.collect()
    # Per region in use, its free list and slot map (arrays: tracked, but walked in O(1)); per block, nothing.
    regions_in_use = sum(r.tenant is not None for r in store.regions)
    assert len(gc.get_objects()) - before <= 2 * regions_in_use + 50
    assert store.stats()["num_blocks"] == 801 and store.counters["evictions"] == 3020 - 800
    assert gc.get_referents(store._slabs.table.keys) == []  # 16-byte keys: none kept on the side
    assert read_lease(store, digest(b"k2999"), "b").block.tenant == "b" and read_lease(store, digest(b"k2999")).block.tenant == "a"
    assert len(store._slabs.table.gen) < 2 * 1024  # ids of evicted blocks are reused: the columns stay small


def test_a_handle_kept_past_its_block_names_that_allocation_only(clock) -> None:
    store = make_store(clock, regions=1, quotas={"a": REGION, "b": REGION})
    put(store, b"old")
    old = read_lease(store, b"old").block
    store.release("a", [])
    assert old.alive
    clock.now += 100  # the lease expires; a put past the quota evicts the block and reuses its id
    for i in range(4):
        put(store, b"new%d" % i)
    assert not old.alive and old.key == b"old" and store.get("a", [b"old"], 1) == [None]
    with pytest.raises(AccessError) as refused:
        store.begin_access("a", old.region.id, old.offset, BLOCK, old.gen, write=False)
    assert refused.value.code is ErrorCode.STALE


def test_keys_of_any_length_come_back_and_only_writing_blocks_keep_write_state(clock) -> None:
    """16-byte keys live in the table's blob, others in a dict; a block's write lease and coverage
    are kept only while it is WRITING (committed, aborted or expired: gone)."""
    store = make_store(clock, regions=4, quotas={"a": 4 * REGION, "b": 4 * REGION})
    keys = [b"d" * 16, b"k", b"x" * 40, bytes(16), b"e" * 16]
    for key in keys:
        assert put(store, key) is GrantStatus.GRANTED
    assert [read_lease(store, key).block.key for key in keys] == keys
    aborted = store.put_begin("a", b"a" * 16, BLOCK, lease_s=30)
    store.abort("a", b"a" * 16, aborted.block.gen)
    store.put_begin("a", b"expires", BLOCK, lease_s=5)
    half = store.put_begin("a", b"h" * 16, BLOCK, lease_s=30)
    access = store.begin_access("a", half.block.region.id, half.block.offset, BLOCK // 2, half.block.gen, write=True)
    store.end_access(access, ok=True)
    table = store._slabs.table
    assert len(table.write_lease) == 2 and table.written == {half.block.id: BLOCK // 2}
    clock.now += 60  # both leases expire: the half-written put and the one never written go
    store.stats()
    assert table.write_lease == {} and table.written == {} and table.islands == {}
    assert len(table) == len(keys) and store.get("a", [b"h" * 16], 1) == [None]


def test_a_region_hands_out_its_slots_lowest_first_and_a_slot_given_back_before_new_ones(clock) -> None:
    store = make_store(clock, regions=1, quotas={"a": REGION, "b": REGION})
    for i in range(3):
        put(store, b"s%d" % i)
    slots = {i: read_lease(store, b"s%d" % i).block.offset // BLOCK for i in range(3)}
    assert slots == {0: 0, 1: 1, 2: 2}
    clock.now += 100  # the read leases expire
    assert store.delete("a", [b"s1"]) == 1
    put(store, b"again")
    put(store, b"last")
    assert read_lease(store, b"again").block.offset // BLOCK == 1 and read_lease(store, b"last").block.offset // BLOCK == 3
    assert store.put_begin("a", b"full", BLOCK, lease_s=30).status is GrantStatus.GRANTED  # by evicting s0
    assert store.get("a", [b"s0"], 1) == [None]
