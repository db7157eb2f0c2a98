"""The pool node's block store, sans-I/O: slot allocator, key index, leases, quotas, eviction.

The node's memory is cut into equal **regions**. A region belongs to one tenant at a time and holds
slots of one size class (the block length rounded up to 4 KiB), like a slab allocator: no
fragmentation, and under RDMA each region is one memory registration whose rkey only its tenant
learns. A **block** is a key's bytes in one slot; its **generation** is unique per allocation, so a
location `(region, offset, gen)` names one incarnation of one slot and a reused slot never answers
to an old location.

States: a block is WRITING (after `put_begin`, invisible to lookups, held by a write lease) until
`commit`, then READY; a mutable block (`alloc`, the Tier adapter's slots) is READY at once and
writable. A block is **busy** while it has a live lease or a data-plane access in flight; a busy
block is never evicted, deleted or reused. Leases expire (checked lazily on every call), so a client
that dies cannot pin memory forever; a WRITING block whose lease expires is dropped.

Eviction is by recency. Room for a block of class c of tenant t is found in this order: a free slot
in one of t's class-c regions; a free region; then the older of (t's least recently used idle
class-c block, the least recently used region with no busy block). A tenant over its quota first
evicts its own least recently used idle blocks. Nothing here does I/O or reads a clock of its own.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from kvtier.pool.blocks import Access, AccessError, Block, BlockState, Grant, Region, TenantState
from kvtier.pool.protocol import ErrorCode, GrantStatus

CLASS_ALIGN_BYTES = 4096


@dataclass(slots=True)
class _Lease:
    block: Block
    expires_at: float
    write: bool


class BlockStore:
    """Index and allocator of one node. Not thread-safe: the server calls it under one lock.

    Args:
        capacity_bytes: the arena; rounded down to whole regions.
        region_bytes: bytes per region (the largest block a node takes).
        quotas: tenant name -> quota in bytes; only these tenants may store.
        clock: seconds, monotonic (lease expiry).
        max_lease_s: the longest lease a client may ask for.
        id_base: first generation and lease id minus one. A node passes a random one so that a
            location or lease from before a restart never names a block or lease after it.
    """

    def __init__(self, capacity_bytes: int, region_bytes: int, quotas: Mapping[str, int],
                 clock: Callable[[], float], max_lease_s: float = 60.0, id_base: int = 0) -> None:
        if region_bytes < CLASS_ALIGN_BYTES or region_bytes % CLASS_ALIGN_BYTES:
            raise ValueError(f"region_bytes must be a positive multiple of {CLASS_ALIGN_BYTES}, got {region_bytes}")
        num_regions = capacity_bytes // region_bytes
        if num_regions < 1:
            raise ValueError(f"capacity {capacity_bytes} bytes is below one region of {region_bytes} bytes")
        self.region_bytes = region_bytes
        self.regions = [Region(i, i * region_bytes, region_bytes) for i in range(num_regions)]
        self._free_regions = list(reversed(self.regions))
        self._tenants = {name: TenantState(q) for name, q in quotas.items()}
        self._clock, self.max_lease_s = clock, max_lease_s
        self._tick = self._num_inflight = 0
        self._gen = self._lease_id = id_base
        self._leases: dict[int, _Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self.counters = dict.fromkeys(("hits", "misses", "puts", "evictions", "leases_expired", "stale",
                                       "bounds", "forbidden", "rejected_full", "rejected_quota",
                                       "rejected_busy", "deleted", "aborted"), 0)

    @property
    def capacity_bytes(self) -> int:
        return len(self.regions) * self.region_bytes

    # ---- control plane --------------------------------------------------------------------

    def put_begin(self, tenant: str, key: bytes, length: int, lease_s: float) -> Grant:
        """Reserves a slot for `key` under a write lease; the block is invisible until `commit`."""
        self._expire()
        t = self._tenants[tenant]
        old = t.index.get(key)
        if old is not None:
            if old.state is BlockState.WRITING:
                self.counters["rejected_busy"] += 1
                return Grant(GrantStatus.BUSY)
            return Grant(GrantStatus.EXISTS)
        grant = self._allocate(tenant, key, length, BlockState.WRITING)
        if grant.block is not None:
            lease = self._lease(grant.block, lease_s, write=True)
            grant.block.write_lease = lease
            return Grant(grant.status, grant.block, lease)
        return grant

    def alloc(self, tenant: str, key: bytes, length: int) -> Grant:
        """A mutable, READY block for `key` (its existing one if of the same length); never leased."""
        self._expire()
        old = self._tenants[tenant].index.get(key)
        if old is not None:
            if old.mutable and old.length == length:
                self._touch(old)
                return Grant(GrantStatus.GRANTED, old)
            return Grant(GrantStatus.EXISTS)
        return self._allocate(tenant, key, length, BlockState.READY, mutable=True)

    def commit(self, tenant: str, key: bytes, gen: int, checksum: int) -> bool:
        """Makes a WRITING block READY. False (and the block is dropped) unless every byte was written;
        False also when the write lease expired or the block is not that generation."""
        self._expire()
        block = self._tenants[tenant].index.get(key)
        if block is None or block.gen != gen or block.state is not BlockState.WRITING:
            return False
        self._drop_lease(block.write_lease)
        if block.written < block.length:
            if not block.busy:
                self._remove(block)
            self.counters["aborted"] += 1
            return False
        block.state, block.checksum = BlockState.READY, checksum
        self.counters["puts"] += 1
        self._touch(block)
        return True

    def abort(self, tenant: str, key: bytes, gen: int) -> None:
        self._expire()
        block = self._tenants[tenant].index.get(key)
        if block is not None and block.gen == gen and block.state is BlockState.WRITING:
            self._drop_lease(block.write_lease)
            if not block.busy:
                self._remove(block)
            self.counters["aborted"] += 1

    def get(self, tenant: str, keys: Sequence[bytes], lease_s: float) -> list[Grant | None]:
        """A read lease on each READY, immutable block under `keys`; None for a miss."""
        return [Grant(GrantStatus.GRANTED, b, self._lease(b, lease_s, write=False)) if b else None
                for b in self.lookup(tenant, keys)]

    def lookup(self, tenant: str, keys: Sequence[bytes]) -> list[Block | None]:
        """The READY, immutable block under each key (None: a miss); counts hits and misses."""
        self._expire()
        index = self._tenants[tenant].index
        out: list[Block | None] = []
        for key in keys:
            block = index.get(key)
            if block is None or block.state is not BlockState.READY or block.mutable:
                self.counters["misses"] += 1
                out.append(None)
                continue
            self.counters["hits"] += 1
            self._touch(block)
            out.append(block)
        return out

    def lease(self, block: Block, lease_s: float) -> int:
        """A read lease on a block `lookup` just returned."""
        return self._lease(block, lease_s, write=False)

    def pin(self, block: Block, write: bool = False) -> Access:
        """An access to the whole of a block this store just handed out: a read of one `lookup`
        returned (the node sends it inline), or the write of one `put_begin` granted (the node
        receives it from the same frame). Its location is the store's own, so nothing is checked."""
        self._set_busy(block, inflight=+1)
        self._num_inflight += 1
        return Access(block, block.region.base + block.offset, block.length, write)

    def release(self, tenant: str, lease_ids: Iterable[int]) -> None:
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is not None and lease.block.tenant == tenant and not lease.write:
                self._drop_lease(lid)
        self._expire()

    def contains(self, tenant: str, keys: Sequence[bytes]) -> list[bool]:
        index = self._tenants[tenant].index
        return [(b := index.get(k)) is not None and b.state is BlockState.READY and not b.mutable for k in keys]

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Drops the tenant's blocks under `keys`; busy blocks are skipped (recency evicts them later)."""
        self._expire()
        index, n = self._tenants[tenant].index, 0
        for key in keys:
            block = index.get(key)
            if block is not None and not block.busy:
                self._remove(block)
                n += 1
        self.counters["deleted"] += n
        return n

    # ---- data plane -----------------------------------------------------------------------

    def begin_access(self, tenant: str, region_id: int, offset: int, length: int, gen: int, write: bool) -> Access:
        """Checks tenant, generation and bounds of a data-plane access and marks the block busy.

        Raises:
            AccessError: STALE (the slot or region holds another allocation now, or another
                tenant's), BOUNDS (no such region; outside the region or the block), FORBIDDEN
                (a write to a committed block, a read of an uncommitted one).
        """
        self._expire()
        if not 0 <= region_id < len(self.regions):
            self.counters["bounds"] += 1
            raise AccessError(ErrorCode.BOUNDS, f"region {region_id} does not exist")
        region = self.regions[region_id]
        if region.tenant != tenant:
            # STALE, not FORBIDDEN: a client whose blocks were evicted may hold a location in a region
            # since freed or handed to another tenant. Either way it learns nothing and reads nothing.
            self.counters["forbidden" if region.tenant is not None else "stale"] += 1
            raise AccessError(ErrorCode.STALE, f"region {region_id} holds none of tenant {tenant!r}'s blocks")
        if offset < 0 or length < 0 or offset + length > region.size:
            self.counters["bounds"] += 1
            raise AccessError(ErrorCode.BOUNDS, f"[{offset}, {offset + length}) is outside region {region_id} "
                                                f"of {region.size} bytes")
        slot, within = divmod(offset, region.slot_bytes)
        block = region.blocks.get(slot)
        if block is None or block.gen != gen:
            self.counters["stale"] += 1
            raise AccessError(ErrorCode.STALE, f"region {region_id} slot {slot} no longer holds generation {gen}")
        if within + length > block.length:
            self.counters["bounds"] += 1
            raise AccessError(ErrorCode.BOUNDS, f"[{within}, {within + length}) is outside the block of "
                                                f"{block.length} bytes at region {region_id} slot {slot}")
        if write and not (block.mutable or block.state is BlockState.WRITING):
            self.counters["forbidden"] += 1
            raise AccessError(ErrorCode.FORBIDDEN, f"block at region {region_id} slot {slot} is committed")
        if not write and block.state is BlockState.WRITING:
            self.counters["forbidden"] += 1
            raise AccessError(ErrorCode.FORBIDDEN, f"block at region {region_id} slot {slot} is not committed")
        self._set_busy(block, inflight=+1)
        self._num_inflight += 1
        if block.mutable:
            self._touch(block)
        return Access(block, region.base + offset, length, write)

    def end_access(self, access: Access, ok: bool) -> None:
        """Ends an access; a successful write counts its bytes toward the block's commit."""
        block = access.block
        if ok and access.write and block.state is BlockState.WRITING:
            block.written += access.length
        self._set_busy(block, inflight=-1)
        self._num_inflight -= 1
        if block.state is BlockState.WRITING and not block.busy and block.write_lease not in self._leases:
            self._remove(block)  # its writer's lease expired while this access was in flight

    # ---- facts ------------------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> dict[str, object]:
        self._expire()
        used = sum(t.used_bytes for t in self._tenants.values())
        out: dict[str, object] = {
            "capacity_bytes": self.capacity_bytes, "used_bytes": used, "region_bytes": self.region_bytes,
            "num_regions": len(self.regions), "free_regions": len(self._free_regions),
            "num_blocks": sum(len(t.index) for t in self._tenants.values()),
            "active_leases": len(self._leases), "accesses_in_flight": self._num_inflight, **self.counters}
        if tenant is not None:
            t = self._tenants[tenant]
            out["tenant"] = {"name": tenant, "used_bytes": t.used_bytes, "quota_bytes": t.quota_bytes,
                             "num_blocks": len(t.index)}
        return out

    # ---- internals --------------------------------------------------------------------------

    def _allocate(self, tenant: str, key: bytes, length: int, state: BlockState, mutable: bool = False) -> Grant:
        slot_bytes = -(-max(length, 1) // CLASS_ALIGN_BYTES) * CLASS_ALIGN_BYTES
        if slot_bytes > self.region_bytes:
            return Grant(GrantStatus.TOO_LARGE)
        t = self._tenants[tenant]
        if not self._fit_quota(t, slot_bytes):
            self.counters["rejected_quota"] += 1
            return Grant(GrantStatus.QUOTA)
        region = self._room(tenant, t, slot_bytes)
        if region is None:
            self.counters["rejected_full"] += 1
            return Grant(GrantStatus.FULL)
        slot = region.free.pop()
        if not region.free:
            t.open_regions[slot_bytes].pop(region.id)
        self._gen += 1
        block = Block(tenant, key, region, slot, length, self._gen, state, mutable)
        region.blocks[slot] = block
        t.index[key] = block
        lru = t.lru.get(slot_bytes)
        if lru is None:
            lru = t.lru[slot_bytes] = OrderedDict()
        lru[key] = block
        t.used_bytes += slot_bytes
        self._touch(block)
        return Grant(GrantStatus.GRANTED, block)

    def _fit_quota(self, t: TenantState, slot_bytes: int) -> bool:
        while t.used_bytes + slot_bytes > t.quota_bytes:
            victim = min(filter(None, (_oldest_idle(lru) for lru in t.lru.values())),
                         key=lambda b: b.last_use, default=None)
            if victim is None:
                return False
            self._evict(victim)
        return True

    def _room(self, tenant: str, t: TenantState, slot_bytes: int) -> Region | None:
        """A region of `tenant`'s class `slot_bytes` with a free slot, evicting by recency if needed."""
        while True:
            open_ = t.open_regions.get(slot_bytes)
            if open_:
                return next(iter(open_.values()))
            if self._free_regions:
                return self._assign(self._free_regions.pop(), tenant, t, slot_bytes)
            own = _oldest_idle(t.lru.get(slot_bytes, {}))
            idle = [r for r in self.regions if r.num_busy == 0 and r.tenant is not None]
            region = min(idle, key=lambda r: r.last_use, default=None)
            if own is None and region is None:
                return None
            if own is not None and (region is None or own.last_use <= region.last_use):
                self._evict(own)
            else:
                for block in list(region.blocks.values()):
                    self._evict(block)

    def _assign(self, region: Region, tenant: str, t: TenantState, slot_bytes: int) -> Region:
        region.tenant, region.slot_bytes = tenant, slot_bytes
        region.free = list(reversed(range(region.size // slot_bytes)))
        t.open_regions.setdefault(slot_bytes, {})[region.id] = region
        return region

    def _evict(self, block: Block) -> None:
        self.counters["evictions"] += 1
        self._remove(block)

    def _remove(self, block: Block) -> None:
        """Frees the block's slot (and its region once empty). The block must not be busy."""
        t, region = self._tenants[block.tenant], block.region
        del t.index[block.key]
        del t.lru[region.slot_bytes][block.key]
        del region.blocks[block.slot]
        region.free.append(block.slot)
        t.used_bytes -= region.slot_bytes
        t.open_regions.setdefault(region.slot_bytes, {})[region.id] = region
        if not region.blocks:
            del t.open_regions[region.slot_bytes][region.id]
            region.tenant, region.slot_bytes, region.free = None, 0, []
            self._free_regions.append(region)

    def _touch(self, block: Block) -> None:
        self._tick += 1
        block.last_use = block.region.last_use = self._tick
        self._tenants[block.tenant].lru[block.region.slot_bytes].move_to_end(block.key)

    def _set_busy(self, block: Block, leases: int = 0, inflight: int = 0) -> None:
        was = block.leases > 0 or block.inflight > 0  # `Block.busy`, inline: three calls per request
        block.leases += leases
        block.inflight += inflight
        now = block.leases > 0 or block.inflight > 0
        if now is not was:
            block.region.num_busy += 1 if now else -1

    def _lease(self, block: Block, lease_s: float, write: bool) -> int:
        self._lease_id += 1
        expires = self._clock() + min(max(lease_s, 0.0), self.max_lease_s)
        self._leases[self._lease_id] = _Lease(block, expires, write)
        heapq.heappush(self._expiry, (expires, self._lease_id))
        self._set_busy(block, leases=+1)
        return self._lease_id

    def _drop_lease(self, lease_id: int) -> _Lease | None:
        lease = self._leases.pop(lease_id, None)
        if lease is not None:
            self._set_busy(lease.block, leases=-1)
        return lease

    def _expire(self) -> None:
        now = self._clock()
        while self._expiry and self._expiry[0][0] <= now:
            _, lid = heapq.heappop(self._expiry)
            lease = self._drop_lease(lid)
            if lease is None:
                continue
            self.counters["leases_expired"] += 1
            block = lease.block
            if lease.write and block.state is BlockState.WRITING and not block.busy:
                self._remove(block)  # an abandoned put


def _oldest_idle(lru: Mapping[bytes, Block]) -> Block | None:
    return next((b for b in lru.values() if not b.busy and b.state is BlockState.READY), None)
