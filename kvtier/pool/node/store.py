"""The pool node's block store, sans-I/O: key index, block states, leases, data-plane checks.

The slots come from `slabs.Slabs` (regions of one tenant and size class each, recency eviction,
quotas, zeroing on hand-over). A **block** is a key's bytes in one slot; its **generation** is
unique per allocation, so a location `(region, offset, gen)` names one incarnation of one slot and
a reused slot never answers to an old location.

States: a block is WRITING (after `put_begin`, invisible to lookups, held by a write lease) until
`commit`, then READY; a mutable block (`alloc`, the Tier adapter's slots) is READY at once and
writable. A block is **busy** while it has a live lease or a data-plane access in flight; a busy
block is never evicted, deleted or reused. Leases expire (checked on every call, and by the node's
reaper between calls: `expire`, at most `EXPIRE_BATCH` per call), so a client that dies cannot pin
memory forever; a WRITING block whose lease expires is dropped. A commit needs
writes that covered the whole block (`blocks.cover`), so no byte of a slot's past is ever readable.

Leases (`leases.LeaseTable`) are bounded per tenant and per connection (`owner`); past a bound a
put is refused (GrantStatus.LIMIT) and a read lease raises AccessError(LIMIT); `disconnect` drops
what a closed connection held. Counters are kept per tenant: `tenant_stats` is what a tenant may
see of the node, `stats` the node-wide view. Nothing here does I/O or reads a clock of its own.
"""

from __future__ import annotations

import collections
import itertools
from array import array
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence

from kvtier.pool.node.blocks import READY_CODE, WRITING_CODE, Access, AccessError, Block, BlockState, Grant, TenantState, cover
from kvtier.pool.node.leases import Lease, LeaseTable
from kvtier.pool.protocol import ErrorCode, GrantStatus
from kvtier.pool.node.retention import RetainOutcome, Retention
from kvtier.pool.node.slabs import TENANT_COUNTERS, Scrub, Slabs, no_memory

_MISS = (False, 0, 0, 0, 0, 0, 0, False)  # a GET's row for a key not found (see `answer_get`)
MAX_LEASES_PER_OWNER = 16384  # 4 full GET frames: a client's pipelined gets release theirs with the next
MAX_LEASES_PER_TENANT = 131072  # ~5 MiB of bookkeeping at most per tenant (`leases.LeaseTable`)
MAX_RETAIN_S = 3600.0  # the longest soft lease (RETAIN) by default, as the engine's `hints.max_retain_s`
RETAIN_FRACTION = 0.5  # of a tenant's quota it may retain by default
EXPIRE_BATCH = 1024  # leases one call ends at most: a flood's expiry is spread over many short holds of the lock


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
        scrub: zeroes node memory (`slabs.Scrub`); the default, for a store without memory, does nothing.
        max_leases_per_owner, max_leases_per_tenant: live leases one connection or tenant may hold.
        on_remove: called with the id of every block that leaves (see `Slabs`).
        max_retain_s: the longest soft lease a RETAIN may set (`retention`).
        retain_fraction: the share of its quota a tenant may retain, in [0, 1].
    Raises:
        ValueError: as `Slabs`, or retain_fraction outside [0, 1].
    """

    def __init__(self, capacity_bytes: int, region_bytes: int, quotas: Mapping[str, int],
                 clock: Callable[[], float], max_lease_s: float = 60.0, id_base: int = 0, *,
                 scrub: Scrub = no_memory, max_leases_per_owner: int = MAX_LEASES_PER_OWNER,
                 max_leases_per_tenant: int = MAX_LEASES_PER_TENANT,
                 on_remove: Callable[[int], None] | None = None, max_retain_s: float = MAX_RETAIN_S,
                 retain_fraction: float = RETAIN_FRACTION) -> None:
        if not 0 <= retain_fraction <= 1:
            raise ValueError(f"retain_fraction must be in [0, 1], got {retain_fraction}")
        retention = Retention(clock, max_retain_s, {name: int(q * retain_fraction) for name, q in quotas.items()})
        self._slabs = Slabs(capacity_bytes, region_bytes, quotas, scrub, id_base, on_remove, retention)
        self.region_bytes, self.regions = region_bytes, self._slabs.regions
        self._tenants, self._table = self._slabs.tenants, self._slabs.table
        self._num_inflight = 0
        self._leases = LeaseTable(clock, max_lease_s, max_leases_per_owner, max_leases_per_tenant, id_base)
        self._dropped_on_close = 0

    @property
    def capacity_bytes(self) -> int:
        return len(self.regions) * self.region_bytes

    @property
    def counters(self) -> dict[str, int]:
        """Node-wide event counts: every tenant's, summed, and the node's own."""
        out = {**self._slabs.counters, "leases_dropped_on_close": self._dropped_on_close}
        for name in TENANT_COUNTERS:
            out[name] = sum(t.counters[name] for t in self._tenants.values())
        return out

    def count(self, tenant: str, name: str, n: int = 1) -> None:
        """Adds `n` to one of `tenant`'s counters (the node counts the bytes it moves here)."""
        self._tenants[tenant].counters[name] += n

    # ---- control plane --------------------------------------------------------------------

    def put_begin(self, tenant: str, key: bytes, length: int, lease_s: float, owner: Hashable | None = None) -> Grant:
        """Reserves a slot for `key` under a write lease taken on `owner` (None: the lease ends with
        the caller's own request, so it counts against the tenant only); the block is invisible
        until `commit`. LIMIT when the tenant or the owner holds as many leases as it may."""
        self.expire()
        t = self._tenants[tenant]
        old = self._table.find(t.code, key)
        if old >= 0:
            if self._table.state[old] == WRITING_CODE:
                t.counters["rejected_busy"] += 1
                return Grant(GrantStatus.BUSY)
            return Grant(GrantStatus.EXISTS)
        if not self._leases.room(t.code, owner):
            t.counters["rejected_limit"] += 1
            return Grant(GrantStatus.LIMIT)
        grant = self._slabs.allocate(tenant, key, length, BlockState.WRITING)
        if grant.block is not None:
            lease = self._lease(grant.block, lease_s, write=True, owner=owner)
            grant.block.write_lease = lease
            return Grant(grant.status, grant.block, lease)
        return grant

    def alloc(self, tenant: str, key: bytes, length: int) -> Grant:
        """A mutable, READY block for `key` (its existing one if of the same length); never leased."""
        self.expire()
        old = self._find(self._tenants[tenant], key)
        if old is not None:
            if old.mutable and old.length == length:
                self._slabs.touch(old)
                return Grant(GrantStatus.GRANTED, old)
            return Grant(GrantStatus.EXISTS)
        return self._slabs.allocate(tenant, key, length, BlockState.READY, mutable=True)

    def commit(self, tenant: str, key: bytes, gen: int, checksum: int,
               holds: Callable[[Block, int], bool] | None = None) -> bool:
        """Makes a WRITING block READY. False (and the block is dropped) unless writes covered every
        byte of it (`blocks.cover`); False also when the write lease expired or the block is not
        that generation.

        Args:
            holds: for writes this store never saw (one-sided RDMA WRITEs): whether the block's
                bytes match `checksum` (the node hashes them); a match stands for full coverage,
                since the client's checksum is of the whole block it meant to write.
        """
        self.expire()
        t, table = self._tenants[tenant], self._table
        i = table.find(t.code, key)  # on the columns: a handle only where the block goes
        if i < 0 or table.gen[i] != gen or table.state[i] != WRITING_CODE:
            return False
        self._drop_lease(table.write_lease.pop(i, 0))
        if table.written.pop(i, 0) < table.length[i] and not (holds is not None and holds(self._slabs.block(i), checksum)):
            if not table.busy[i]:
                self._slabs.remove(i)
            t.counters["aborted"] += 1
            return False
        table.state[i], table.checksum[i] = READY_CODE, checksum
        table.islands.pop(i, None)  # what only a WRITING block keeps (see BlockTable)
        t.counters["puts"] += 1
        self._slabs.touch_id(i)
        return True

    def abort(self, tenant: str, key: bytes, gen: int) -> None:
        self.expire()
        block = self._find(self._tenants[tenant], key)
        if block is not None and block.gen == gen and block.state is BlockState.WRITING:
            self._drop_lease(block.write_lease)
            if not block.busy:
                self._slabs.remove(block)
            self._tenants[tenant].counters["aborted"] += 1

    def get(self, tenant: str, keys: Sequence[bytes], lease_s: float,
            owner: Hashable | None = None) -> list[Grant | None]:
        """A read lease on each READY, immutable block under `keys`; None for a miss.

        Raises:
            AccessError(LIMIT): the hits would take the tenant or `owner` past its lease bound;
                then nothing is leased (and nothing counted but the refusal).
        """
        ids = self.find(tenant, keys)
        self.check_lease_room(tenant, owner, len(ids) - ids.count(-1))
        rows, _ = self.answer_get(tenant, ids, [False] * len(ids), lease_s, owner)
        return [Grant(GrantStatus.GRANTED, self._slabs.block(i), row[6]) if i >= 0 else None
                for i, row in zip(ids, rows)]

    def find(self, tenant: str, keys: Sequence[bytes]) -> list[int]:
        """The id of the READY, immutable block under each key (-1: a miss). Counts and touches
        nothing (`answer_get` does, for what is served)."""
        self.expire()
        return list(self._ready_ids(tenant, keys))

    def check_hits_room(self, tenant: str, owner: Hashable | None, keys: Sequence[bytes]) -> None:
        """`check_lease_room` for a GET whose every hit is leased, before its keys are looked up:
        hits are counted only until they pass the room left, so a GET refused because its sender
        is at its bound (a flood's) costs a lookup or two, not 4,096, while other tenants wait on
        the node's lock. Raises as `check_lease_room`."""
        room = self._leases.room(self._tenants[tenant].code, owner)
        if room < len(keys):
            hits = itertools.islice((i for i in self._ready_ids(tenant, keys) if i >= 0), room + 1)
            self.check_lease_room(tenant, owner, sum(1 for _ in hits))

    def plan_inline(self, ids: Sequence[int], budget_bytes: int) -> list[bool]:
        """Which of `find`'s hits a reply of at most `budget_bytes` of block bytes carries, in order."""
        length, out = self._table.length, []
        for i in ids:
            fits = i >= 0 and length[i] <= budget_bytes
            budget_bytes -= length[i] if fits else 0
            out.append(fits)
        return out

    def answer_get(self, tenant: str, ids: Sequence[int], inline: Sequence[bool], lease_s: float,
                   owner: Hashable | None) -> tuple[Iterator[tuple], list[Access]]:
        """A GET's answer for `find`'s `ids`: its rows (`protocol.encode_hits`: found, region,
        offset, length, gen, checksum, lease, inline), made one at a time as they are read, and
        the accesses of the hits sent `inline` (pinned: end each with `end_access`). The rows may
        be read after the caller's lock is let go: every hit is leased or pinned by then, so
        nothing they read of it changes (a busy block is never evicted, moved or rewritten). The other hits are leased, in one batch (the caller checked
        `check_lease_room`). Counts hits and misses; each hit becomes the most recently used,
        the last asked for last (a block asked for many times moves once, at its last place)."""
        counters, num_misses = self._tenants[tenant].counters, ids.count(-1)
        counters["hits"] += len(ids) - num_misses
        counters["misses"] += num_misses
        for i in reversed(dict.fromkeys(reversed(ids))):
            if i >= 0:
                self._slabs.touch_id(i)
        leased = [i for i, inl in zip(ids, inline) if i >= 0 and not inl]
        leases = self._lease_ids(leased, self._tenants[tenant].code, lease_s, False, owner)
        pinned = [self.pin(self._slabs.block(i)) for i, inl in zip(ids, inline) if inl]
        return self._hit_rows(ids, inline, iter(leases)), pinned

    def _ready_ids(self, tenant: str, keys: Sequence[bytes]) -> Iterator[int]:
        table = self._table
        state, mutable = table.state, table.mutable
        found = map(table.keys.find, keys, itertools.repeat(self._tenants[tenant].code))
        return (i if i >= 0 and state[i] == READY_CODE and not mutable[i] else -1 for i in found)

    def _hit_rows(self, ids: Sequence[int], inline: Sequence[bool], leases: Iterator[int]) -> Iterator[tuple]:
        table, regions = self._table, self.regions
        for i, inl in zip(ids, inline):
            if i < 0:
                yield _MISS
                continue
            region = regions[table.region[i]]
            yield (True, region.id, table.slot[i] * region.slot_bytes, table.length[i], table.gen[i],
                   table.checksum[i], 0 if inl else next(leases), inl)

    def check_lease_room(self, tenant: str, owner: Hashable | None, n: int) -> None:
        """Raises AccessError(LIMIT) unless `tenant` may take `n` more leases on `owner`."""
        t = self._tenants[tenant]
        if n and self._leases.room(t.code, owner) < n:
            t.counters["rejected_limit"] += 1
            held = self._leases.count(t.code)
            raise AccessError(ErrorCode.LIMIT, f"{n} more leases would pass a bound: tenant {tenant!r} holds "
                                               f"{held} (max {self._leases.max_per_tenant}), at most "
                                               f"{self._leases.max_per_owner} per connection; release some")

    def pin(self, block: Block, write: bool = False) -> Access:
        """An access to the whole of a block this store just handed out: a read of one `find`
        returned (the node sends it inline), or the write of one `put_begin` granted (the node
        receives it from the same frame). Its location is the store's own, so nothing is checked."""
        self._add_busy(block.id, +1)
        self._num_inflight += 1
        return Access(block, block.region.base + block.offset, block.length, write)

    def release(self, tenant: str, lease_ids: Iterable[int]) -> None:
        """Ends the tenant's read leases among `lease_ids` (others' and unknown ids are ignored)."""
        code = self._tenants[tenant].code
        for lid in lease_ids:
            lease = self._leases.get(lid)
            if lease is not None and lease.tenant == code and not lease.write:
                self._drop_lease(lid)
        self.expire()

    def disconnect(self, owner: Hashable) -> None:
        """Drops every lease taken on `owner` (a connection that closed): its reads are over, and
        its puts not committed are abandoned."""
        for lease in self._leases.drop_owner(owner):
            self._dropped_on_close += 1
            self._add_busy(lease.block, -1)
            self._end_lease(lease)

    def contains(self, tenant: str, keys: Sequence[bytes], touch: bool = False) -> list[bool]:
        """Whether the tenant holds a READY shared block under each key; `touch`: each one found
        becomes the most recently used (a client's CONTAINS: it asks for a block it is about to
        load, or one it would have sent again, so that block should not be the next evicted)."""
        code, found, table = self._tenants[tenant].code, [], self._slabs.table
        find, state, mutable = table.keys.find, table.state, table.mutable
        for key in keys:
            block = find(key, code)
            hit = block >= 0 and state[block] == READY_CODE and not mutable[block]
            if hit and touch:
                self._slabs.touch(self._slabs.block(block))
            found.append(hit)
        return found

    def retain(self, tenant: str, keys: Sequence[bytes], ttl_s: float) -> RetainOutcome:
        """RETAIN: a soft lease of `ttl_s` (capped) on the tenant's READY blocks under `keys`
        (see `retention`); what it came to, counted in the tenant's stats."""
        return self._slabs.retain(tenant, self.find(tenant, keys), ttl_s)

    def release_hint(self, tenant: str, keys: Sequence[bytes]) -> int:
        """RELEASE_HINT: the tenant's READY blocks under `keys` lose their lease and become its
        least recently used; returns how many."""
        return self._slabs.release_hint(tenant, self.find(tenant, keys))

    def delete(self, tenant: str, keys: Sequence[bytes]) -> int:
        """Drops the tenant's blocks under `keys`; busy blocks are skipped (recency evicts them later)."""
        self.expire()
        t, n = self._tenants[tenant], 0
        for key in keys:
            block = self._find(t, key)
            if block is not None and not block.busy:
                self._slabs.remove(block)
                n += 1
        self._tenants[tenant].counters["deleted"] += n
        return n

    def expire(self, limit: int = EXPIRE_BATCH) -> int:
        """Ends up to `limit` leases whose time has come (the node's reaper calls this between
        requests, so that expired leases go without traffic); returns how many ended."""
        expired = self._leases.pop_expired(limit)
        names, tenants = self._table.tenant_names, self._tenants
        for lease in expired:
            self._add_busy(lease.block, -1)
            tenants[names[lease.tenant]].counters["leases_expired"] += 1
            if lease.write:
                self._end_lease(lease)
        return len(expired)

    @property
    def lease_slots(self) -> int:
        """Slots of the lease table, live or free: what its memory is proportional to."""
        return self._leases.num_slots

    def next_expiry_s(self) -> float | None:
        """The clock reading at which the next lease may expire; None while none is held."""
        return self._leases.next_expiry_s()

    # ---- data plane -----------------------------------------------------------------------

    def begin_access(self, tenant: str, region_id: int, offset: int, length: int, gen: int, write: bool) -> Access:
        """Checks tenant, generation and bounds of a data-plane access and marks the block busy.

        Raises:
            AccessError: STALE (the slot or region holds another allocation now, or another
                tenant's), BOUNDS (no such region; outside the region or the block), FORBIDDEN
                (a write to a committed block, a read of an uncommitted one).
        """
        self.expire()
        if not 0 <= region_id < len(self.regions):
            raise self._refused(tenant, "bounds", ErrorCode.BOUNDS, f"region {region_id} does not exist")
        region = self.regions[region_id]
        if region.tenant != tenant:
            # STALE, not FORBIDDEN: a client whose blocks were evicted may hold a location in a region
            # since freed or handed to another tenant. Either way it learns nothing and reads nothing.
            raise self._refused(tenant, "forbidden" if region.tenant is not None else "stale", ErrorCode.STALE,
                                f"region {region_id} holds none of tenant {tenant!r}'s blocks")
        if offset < 0 or length < 0 or offset + length > region.size:
            raise self._refused(tenant, "bounds", ErrorCode.BOUNDS, f"[{offset}, {offset + length}) is outside "
                                                                    f"region {region_id} of {region.size} bytes")
        slot, within = divmod(offset, region.slot_bytes)
        found = region.ids[slot] if region.ids is not None and slot < len(region.ids) else -1
        block = self._slabs.block(found) if found >= 0 else None
        where = f"region {region_id} slot {slot}"
        if block is None or block.gen != gen:
            raise self._refused(tenant, "stale", ErrorCode.STALE, f"{where} no longer holds generation {gen}")
        if within + length > block.length:
            raise self._refused(tenant, "bounds", ErrorCode.BOUNDS, f"[{within}, {within + length}) is outside "
                                                                    f"the block of {block.length} bytes at {where}")
        if write and not (block.mutable or block.state is BlockState.WRITING):
            raise self._refused(tenant, "forbidden", ErrorCode.FORBIDDEN, f"block at {where} is committed")
        if not write and block.state is BlockState.WRITING:
            raise self._refused(tenant, "forbidden", ErrorCode.FORBIDDEN, f"block at {where} is not committed")
        self._add_busy(block.id, +1)
        self._num_inflight += 1
        if block.mutable:
            self._slabs.touch(block)
        return Access(block, region.base + offset, length, write)

    def end_access(self, access: Access, ok: bool) -> None:
        """Ends an access; a successful write into a WRITING block covers its range toward the commit."""
        block = access.block
        writing = self._table.state[block.id] == WRITING_CODE and block.alive
        if ok and access.write and writing:
            start = access.arena_offset - block.region.base - block.offset
            cover(block, start, start + access.length)
        self._add_busy(block.id, -1)
        self._num_inflight -= 1
        if writing and not block.busy and self._leases.get(block.write_lease) is None:
            self._slabs.remove(block)  # its writer's lease expired while this access was in flight

    # ---- facts ------------------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> dict[str, object]:
        """The node-wide view (the operator's): use, leases and every counter; with `tenant`, also
        that tenant's own figures under "tenant"."""
        self.expire()
        tenants = self._tenants.values()
        out: dict[str, object] = {
            **self.facts(), "used_bytes": sum(t.used_bytes for t in tenants),
            "free_regions": len(self._slabs.free_regions), "num_blocks": sum(t.num_blocks for t in tenants),
            "active_leases": len(self._leases),
            "lease_heap_entries": self._leases.heap_entries, "lease_slots": self.lease_slots,
            "accesses_in_flight": self._num_inflight, "retained_blocks": self._num_retained(), **self.counters}
        if tenant is not None:
            out["tenant"] = self._tenant_facts(tenant)
        return out

    def tenant_stats(self, tenant: str) -> dict[str, object]:
        """What `tenant` may see: the static facts, its own use, quota, leases and counters, and
        nothing of other tenants' activity (not even the node's free space, which they change)."""
        self.expire()
        own = self._tenant_facts(tenant)
        return {**self.facts(), **{k: own[k] for k in ("used_bytes", "quota_bytes", "num_blocks", "active_leases",
                                                       "retained_blocks", "retained_bytes", "retain_quota_bytes")},
                **self._tenants[tenant].counters, "tenant": own}

    def facts(self) -> dict[str, object]:
        """What never changes: capacity and how it is cut."""
        return {"capacity_bytes": self.capacity_bytes, "region_bytes": self.region_bytes,
                "num_regions": len(self.regions)}

    def _num_retained(self) -> int:
        """Blocks under a soft lease now, every tenant's."""
        self._slabs.retention.lapse()
        return len(self._slabs.retention)

    def _tenant_facts(self, tenant: str) -> dict[str, object]:
        t = self._tenants[tenant]
        return {"name": tenant, "used_bytes": t.used_bytes, "quota_bytes": t.quota_bytes,
                "num_blocks": t.num_blocks, "active_leases": self._leases.count(t.code),
                **self._slabs.retention.facts(tenant)}

    # ---- internals --------------------------------------------------------------------------

    def _find(self, t: TenantState, key: bytes) -> Block | None:
        """A handle on the tenant's block under `key`, or None."""
        block = self._table.find(t.code, key)
        return None if block < 0 else self._slabs.block(block)

    def _add_busy(self, block: int, delta: int) -> None:
        """Adds `delta` to block id `block`'s busy count (live leases plus accesses in flight; one
        count of both: what matters is whether any holds the block), and keeps its region's count
        of busy blocks. On the table's column, not a handle: three calls per request."""
        busy = self._table.busy
        was = busy[block]
        now = was + delta
        busy[block] = now
        if (now > 0) is not (was > 0):
            self.regions[self._table.region[block]].num_busy += 1 if now > 0 else -1

    def _lease(self, block: Block, lease_s: float, write: bool, owner: Hashable | None) -> int:
        return self._lease_ids([block.id], self._tenants[block.tenant].code, lease_s, write, owner)[0]

    def _lease_ids(self, ids: list[int], tenant: int, lease_s: float, write: bool, owner: Hashable | None) -> array:
        """Leases on block ids `ids` (tenant code `tenant`'s), in one batch; returns their ids."""
        for i, n in (collections.Counter(ids).items() if len(ids) > 8 else zip(ids, itertools.repeat(1))):
            self._add_busy(i, n)  # a key asked for many times (a flood's): one update
        return self._leases.add(ids, tenant, lease_s, write, owner)

    def _drop_lease(self, lease_id: int) -> Lease | None:
        lease = self._leases.drop(lease_id)
        if lease is not None:
            self._add_busy(lease.block, -1)
        return lease

    def _end_lease(self, lease: Lease) -> None:
        """After a lease was dropped unreleased (expired, or its connection closed): an abandoned
        put's block goes. (A leased block is busy, so the id still names the block leased.)"""
        table = self._table
        if lease.write and table.state[lease.block] == WRITING_CODE and not table.busy[lease.block]:
            self._slabs.remove(lease.block)

    def _refused(self, tenant: str, counter: str, code: ErrorCode, message: str) -> AccessError:
        """Counts a refused access under `tenant` and returns the error to raise."""
        self._tenants[tenant].counters[counter] += 1
        return AccessError(code, message)
