"""The pool node's slot allocator, sans-I/O: regions cut into slots, per-tenant recency and quota.

The node's memory is cut into equal **regions**. A region belongs to one tenant at a time and holds
slots of one size class (the block length rounded up to 4 KiB), like a slab allocator: no
fragmentation, and under RDMA each region is one memory registration whose rkey only its tenant
learns.

Room for a block of class c of tenant t is found in this order: a free slot in one of t's class-c
regions; a free region; then the older of (t's least recently used idle class-c block, the least
recently used region with no busy block). A tenant over its quota first evicts its own least
recently used idle blocks. Blocks under a soft lease (`retention`: RETAIN) and regions holding any
are passed over while anything else can go, and taken only then: a lease never refuses a put.

No tenant is handed bytes another wrote. A region handed to another tenant than its last one is
zeroed first (the `scrub` hook, given by the node: nothing here touches memory), over the extent
allocated since it was last zeroed; a mutable block, readable at once, is zeroed at allocation when
its slot lies in that extent. Why here and not a memset per put: a hand-over happens once per
region and change of tenant, and a mutable block is allocated once per slot of the Tier adapter,
whereas puts are the hot path (their blocks are only readable once written whole: `blocks.cover`).
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Mapping

from kvtier.pool.node.blocks import READY_CODE, Block, BlockState, BlockTable, Grant, Recency, Region, TenantState
from kvtier.pool.node.retention import RetainOutcome, Retention
from kvtier.pool.protocol import GrantStatus

CLASS_ALIGN_BYTES = 4096
TENANT_COUNTERS = ("hits", "misses", "puts", "evictions", "leases_expired", "stale", "bounds", "forbidden",
                   "rejected_full", "rejected_quota", "rejected_busy", "rejected_limit", "rejected_checksum", "deleted", "aborted",
                   "bytes_in", "bytes_out", "duplicate_put_bytes",
                   "retained", "retain_ignored_over_budget", "released", "retained_evicted")
# Zeroes `length` bytes at `start` of a region; `hand_over`: the region passes to another tenant
# (an RDMA node also replaces the region's memory registration then). Returns the bytes zeroed.
Scrub = Callable[[Region, int, int, bool], int]


def no_memory(region: Region, start: int, length: int, hand_over: bool) -> int:
    """The `Scrub` of a store without memory behind it (unit tests): nothing to zero."""
    return length


class Slabs:
    """Regions, free regions, the blocks (`table`), and each tenant's index, recency lists and use.
    Not thread-safe.

    Args:
        capacity_bytes: the arena; rounded down to whole regions.
        region_bytes: bytes per region (the largest block a node takes).
        quotas: tenant name -> quota in bytes.
        scrub: zeroes node memory (see `Scrub`).
        id_base: the first generation minus one.
        on_remove: called with a block's id as it leaves, whatever the path (the node's events).
        retention: the soft leases eviction passes over (None: none are ever granted).
    Raises:
        ValueError: region_bytes not a positive multiple of 4 KiB or not below 4 GiB, or capacity below one region.
    """

    def __init__(self, capacity_bytes: int, region_bytes: int, quotas: Mapping[str, int],
                 scrub: Scrub = no_memory, id_base: int = 0, on_remove: Callable[[int], None] | None = None,
                 retention: Retention | None = None) -> None:
        if region_bytes < CLASS_ALIGN_BYTES or region_bytes % CLASS_ALIGN_BYTES:
            raise ValueError(f"region_bytes must be a positive multiple of {CLASS_ALIGN_BYTES}, got {region_bytes}")
        if region_bytes >= 2**32:  # a block's length is kept in 32 bits (`BlockTable.length`)
            raise ValueError(f"region_bytes must be below 4 GiB, got {region_bytes}")
        num_regions = capacity_bytes // region_bytes
        if num_regions < 1:
            raise ValueError(f"capacity {capacity_bytes} bytes is below one region of {region_bytes} bytes")
        self.region_bytes = region_bytes
        self.regions = [Region(i, i * region_bytes, region_bytes) for i in range(num_regions)]
        self.free_regions = list(reversed(self.regions))
        self.table = BlockTable(self.regions)
        self.tenants = {name: TenantState(q, dict.fromkeys(TENANT_COUNTERS, 0), self.table.tenant_code(name))
                        for name, q in quotas.items()}
        self.counters = dict.fromkeys(("region_handovers", "scrubbed_bytes"), 0)
        self._scrub, self._on_remove = scrub, on_remove
        self.retention = retention if retention is not None else Retention(lambda: 0.0, 0.0, dict.fromkeys(quotas, 0))
        self._tick = 0
        self._gen = id_base

    def allocate(self, tenant: str, key: bytes, length: int, state: BlockState, mutable: bool = False) -> Grant:
        """A new block for `key` in a slot found (or freed) for it; TOO_LARGE, QUOTA or FULL when none."""
        slot_bytes = -(-max(length, 1) // CLASS_ALIGN_BYTES) * CLASS_ALIGN_BYTES
        if slot_bytes > self.region_bytes:
            return Grant(GrantStatus.TOO_LARGE)
        t = self.tenants[tenant]
        if not self._fit_quota(t, slot_bytes):
            t.counters["rejected_quota"] += 1
            return Grant(GrantStatus.QUOTA)
        region = self._room(tenant, t, slot_bytes)
        if region is None:
            t.counters["rejected_full"] += 1
            return Grant(GrantStatus.FULL)
        slot = region.take_slot()
        if not region.has_room():
            t.open_regions[slot_bytes].pop(region.id)
        offset = slot * slot_bytes
        if mutable and offset < region.dirty_bytes:  # readable at once: no older bytes may show
            self.counters["scrubbed_bytes"] += self._scrub(region, offset, length, False)
        region.dirty_bytes = max(region.dirty_bytes, offset + slot_bytes)
        self._gen += 1
        block = self.table.add(tenant, key, region, slot, length, self._gen, state, mutable)
        region.ids[slot] = block
        region.num_blocks += 1
        t.num_blocks += 1
        lru = t.lru.get(slot_bytes)
        if lru is None:
            lru = t.lru[slot_bytes] = Recency(self.table)
        lru.push(block)
        t.used_bytes += slot_bytes
        handle = Block(self.table, block)
        self.touch(handle)
        return Grant(GrantStatus.GRANTED, handle)

    def block(self, block: int) -> Block:
        """A handle on block id `block`."""
        return Block(self.table, block)

    def remove(self, block: Block | int) -> None:
        """Frees the block's slot (and its region once empty); `block`: a handle or an id. The block
        must not be busy."""
        i = block if block.__class__ is int else block.id
        if self._on_remove is not None:
            self._on_remove(i)
        self.retention.forget(i)
        table = self.table
        region, slot = self.regions[table.region[i]], table.slot[i]
        t = self.tenants[region.tenant]
        t.num_blocks -= 1
        t.lru[region.slot_bytes].unlink(i)
        region.ids[slot] = -1
        region.num_blocks -= 1
        table.remove(i)
        region.free.append(slot)
        t.used_bytes -= region.slot_bytes
        t.open_regions.setdefault(region.slot_bytes, {})[region.id] = region
        if not region.num_blocks:
            del t.open_regions[region.slot_bytes][region.id]
            region.tenant, region.slot_bytes, region.free, region.ids = None, 0, array("i"), None
            region.fresh = region.num_slots = 0
            self.free_regions.append(region)

    def touch(self, block: Block) -> None:
        """Makes `block` (and its region) the most recently used."""
        self.touch_id(block.id)

    def touch_id(self, block: int) -> None:
        """`touch` of block id `block`."""
        table = self.table
        region = self.regions[table.region[block]]
        self._tick += 1
        table.last_use[block] = region.last_use = self._tick
        self.tenants[region.tenant].lru[region.slot_bytes].move_to_end(block)

    def _fit_quota(self, t: TenantState, slot_bytes: int) -> bool:
        while t.used_bytes + slot_bytes > t.quota_bytes:
            victim = self._oldest_of(t, spare=True)
            if victim < 0:
                victim = self._oldest_of(t, spare=False)  # only retained blocks are left: soft
            if victim < 0:
                return False
            self._evict(victim)
        return True

    def _oldest_of(self, t: TenantState, spare: bool) -> int:
        """The least recently used idle block of any of `t`'s classes (`spare`: not retained), or -1."""
        last_use = self.table.last_use
        return min(filter(lambda b: b >= 0, (self._oldest_idle(lru, spare) for lru in t.lru.values())),
                   key=last_use.__getitem__, default=-1)

    def _room(self, tenant: str, t: TenantState, slot_bytes: int) -> Region | None:
        """A region of `tenant`'s class `slot_bytes` with a free slot, evicting by recency if needed."""
        while True:
            open_ = t.open_regions.get(slot_bytes)
            if open_:
                return next(iter(open_.values()))
            if self.free_regions:  # popped once assigned: a scrub that raises leaves it free
                region = self._assign(self.free_regions[-1], tenant, t, slot_bytes)
                self.free_regions.pop()
                return region
            own, region = self._oldest_idle(t.lru.get(slot_bytes), True), self._oldest_region(True)
            if own < 0 and region is None:  # only retained blocks are left: soft, they go too
                own, region = self._oldest_idle(t.lru.get(slot_bytes), False), self._oldest_region(False)
            if own < 0 and region is None:
                return None
            if own >= 0 and (region is None or self.table.last_use[own] <= region.last_use):
                self._evict(own)
            else:
                for block in region.block_ids():
                    self._evict(block)

    def _assign(self, region: Region, tenant: str, t: TenantState, slot_bytes: int) -> Region:
        """Hands a free region to `tenant` for class `slot_bytes`, zeroed first when it may hold
        another tenant's bytes."""
        if region.last_tenant is not None and region.last_tenant != tenant:
            self.counters["region_handovers"] += 1
            self.counters["scrubbed_bytes"] += self._scrub(region, 0, region.dirty_bytes, True)
            region.dirty_bytes = 0
        region.last_tenant = tenant
        region.tenant, region.slot_bytes = tenant, slot_bytes
        slots = region.size // slot_bytes
        region.free, region.fresh, region.num_slots = array("i"), 0, slots  # slot 0 is handed out first
        region.ids = array("i", [-1]) * slots
        t.open_regions.setdefault(slot_bytes, {})[region.id] = region
        return region

    def _oldest_idle(self, lru: Recency | None, spare: bool = True) -> int:
        """The id of the least recently used block of `lru` that is READY and idle (`spare`: and
        not retained), or -1."""
        if lru is None:
            return -1
        table, retention = self.table, self.retention
        busy, state = table.busy, table.state
        if spare and len(retention):
            retention.lapse()
        retained = retention.holds if spare and len(retention) else None
        for block in lru:
            if not busy[block] and state[block] == READY_CODE and (retained is None or not retained(block)):
                return block
        return -1

    def _oldest_region(self, spare: bool) -> Region | None:
        """The least recently used assigned region with no busy block (`spare`: and no retained one)."""
        retained = self.retention.holds_in if spare and len(self.retention) else None
        idle = [r for r in self.regions if r.num_busy == 0 and r.tenant is not None
                and (retained is None or not retained(r.id))]
        return min(idle, key=lambda r: r.last_use, default=None)

    def _evict(self, block: int) -> None:
        """Evicts block id `block` (idle)."""
        region = self.regions[self.table.region[block]]
        counters = self.tenants[region.tenant].counters  # the owner's: it sees its blocks go
        counters["evictions"] += 1
        if self.retention.holds(block):
            counters["retained_evicted"] += 1
        self.remove(block)

    # ---- soft leases (RETAIN, RELEASE_HINT; see `retention`) ------------------------------------

    def retain(self, tenant: str, ids: list[int], ttl_s: float) -> RetainOutcome:
        """Retains the tenant's READY blocks `ids` (-1: a key it does not hold) for `ttl_s`, within its budget."""
        table, regions = self.table, self.regions
        found = [(i, table.region[i], regions[table.region[i]].slot_bytes) for i in dict.fromkeys(ids) if i >= 0]
        out = self.retention.retain(tenant, found, ttl_s)
        counters = self.tenants[tenant].counters
        counters["retained"] += out.retained
        counters["retain_ignored_over_budget"] += out.over_budget
        return RetainOutcome(out.retained, out.over_budget, ids.count(-1))

    def release_hint(self, tenant: str, ids: list[int]) -> int:
        """Ends the retention of the tenant's blocks `ids` (-1: not held) and makes them its least
        recently used, the first listed first (its session closed: they are the next to go)."""
        table, n = self.table, 0
        for i in reversed(dict.fromkeys(i for i in ids if i >= 0)):
            self.retention.forget(i)
            region = self.regions[table.region[i]]
            self.tenants[tenant].lru[region.slot_bytes].move_to_front(i)
            table.last_use[i] = 0  # older than any region too (`_room` compares the two)
            n += 1
        self.tenants[tenant].counters["released"] += n
        return n
