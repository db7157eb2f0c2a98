"""The leases of one node's blocks, sans-I/O: ids, expiry, and how many each holder may have.

A lease keeps a block busy (never evicted, deleted or reused) until it is released or expires.
Each lease counts against its tenant and, when it was taken on a connection (`owner`), against
that connection, so that no client — a flood of GETs that never release, say — can make the node
hold unbounded memory or slow down everyone's requests; what a connection held is dropped when it
closes. `BlockStore` keeps the blocks' busy counts; this table only keeps the leases.

Why columns, not an object per lease (issue 29, finding 6): a flood at the per-tenant bound holds
131,072 leases. As objects (a lease, its block handle, a heap tuple, a dict and a set entry) they
took the node from 56 to 126 MB, kept it there after every lease had expired (freed objects
scattered over the allocator's arenas), and gave the garbage collector half a million objects
to walk on each full collection, 60-200 ms with the GIL held: another tenant's gets stalled for
up to 955 ms. Here a lease is a **slot** in a few `array` columns (about 40 bytes, nothing the
collector tracks); its id is `stamp << 32 | slot`, so finding it needs no dict, and a stamp that
differs per lease makes a stale or forged id name nothing. Free slots are reused lowest first, and
once most of the table is free it is cut back to its highest live slot: the memory of expired
leases goes back within one lease time at most.

Expiry is by due time: the slots of the leases that expire at one microsecond (one GET's hits
expire together) are one `array` under that time, and a heap holds the distinct times, so a GET
of 4,096 hits adds one heap entry, not 4,096 (each a Python int, which the flood left scattered
over the allocator's arenas). A lease released early stays in its bucket until its time comes (its
slot no longer matches then); the buckets are rebuilt from the live leases when they grow much
larger than them. `pop_expired` looks at `limit` slots per call at most, so no caller holds the
node's lock for a whole flood's expiry.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Callable, Hashable, Sequence
from typing import NamedTuple

_SLOT_BITS = 32
_SLOT_MASK = (1 << _SLOT_BITS) - 1
_NUM_STAMPS = (1 << 32) - 1  # a lease id's stamp: 1 .. 2**32 - 1 (an id is never 0, "no lease")
_COMPACT_SLACK = 1024  # heap entries beyond twice the live leases, free slots beyond a quarter, before a rebuild
_NO_OWNER = -1


def _us(t_s: float) -> int:
    """A clock reading in whole microseconds: what expiry compares (one rounding for both sides)."""
    return int(t_s * 1_000_000)


class Lease(NamedTuple):
    """What a lease holds: a block id of the store's table, its tenant's code, read or write."""

    block: int
    tenant: int
    write: bool


class LeaseTable:
    """Live leases as columns by slot. Not thread-safe (the store's caller locks).

    Args:
        clock: seconds, monotonic.
        max_lease_s: the longest lease granted, whatever is asked for.
        max_per_owner, max_per_tenant: the most live leases one owner (connection) or one tenant holds.
        id_base: picks the first lease id's stamp; a node passes a random one so that a lease id
            from before a restart names no lease after it.
    """

    def __init__(self, clock: Callable[[], float], max_lease_s: float, max_per_owner: int,
                 max_per_tenant: int, id_base: int = 0) -> None:
        self._clock, self.max_lease_s = clock, max_lease_s
        self.max_per_owner, self.max_per_tenant = max_per_owner, max_per_tenant
        self._stamp = id_base % _NUM_STAMPS
        self._num_live = 0
        self._per_tenant: dict[int, int] = {}
        self._owner_codes: dict[Hashable, int] = {}  # owners holding leases -> their code in `_owner`
        self._owner_keys: dict[int, Hashable] = {}  # and back
        self._per_owner: dict[int, int] = {}  # owner code -> live leases
        self._next_owner = 0
        self._reset()

    def _reset(self) -> None:
        """Empty columns (new objects: the old ones' memory goes back)."""
        self._lid = array("Q")  # 0: a free slot
        self._block = array("i")
        self._tenant = array("H")
        self._write = bytearray()
        self._owner = array("q")
        self._expires_us = array("q")
        self._free = array("i")  # free slots below the top, the next one last
        self._due: dict[int, array] = {}  # expiry (µs) -> the slots leased until then, released ones too
        self._due_order: list[int] = []  # a heap of `_due`'s keys
        self._num_due = 0  # slots in all of `_due`
        self._drops_since_compact = 0

    def __len__(self) -> int:
        return self._num_live

    @property
    def heap_entries(self) -> int:
        """Slots waiting for their expiry, released leases not yet compacted away included."""
        return self._num_due

    @property
    def num_slots(self) -> int:
        """Slots in the columns, live or free: what the table's memory is proportional to."""
        return len(self._lid)

    def count(self, tenant: int) -> int:
        return self._per_tenant.get(tenant, 0)

    def room(self, tenant: int, owner: Hashable | None) -> int:
        """How many more leases tenant code `tenant` may take on `owner` (None: no owner bound) now."""
        left = self.max_per_tenant - self._per_tenant.get(tenant, 0)
        if owner is not None:
            code = self._owner_codes.get(owner)
            left = min(left, self.max_per_owner - (self._per_owner[code] if code is not None else 0))
        return max(left, 0)

    def get(self, lease_id: int) -> Lease | None:
        """The live lease `lease_id` names, or None (expired, released, never granted, forged)."""
        slot = lease_id & _SLOT_MASK
        if slot >= len(self._lid) or self._lid[slot] != lease_id:
            return None
        return Lease(self._block[slot], self._tenant[slot], bool(self._write[slot]))

    def next_expiry_s(self) -> float | None:
        """When the earliest lease comes due (a released one's included), or None."""
        return self._due_order[0] / 1_000_000 if self._due_order else None

    def add(self, blocks: Sequence[int], tenant: int, lease_s: float, write: bool,
                 owner: Hashable | None) -> array:
        """A lease on each of block ids `blocks` of tenant code `tenant` (one GET's hits, or one
        put's block), all for `min(lease_s, max_lease_s)`; returns their ids (an `array` of
        uint64: no object per lease). The caller has checked `room` (this table does not refuse).

        Why a batch: a GET of 4,096 hits is one lock hold, and a lease apiece was most of it.
        The leases share one stamp: their slots differ, and a slot's next lease gets the next stamp.
        """
        n = len(blocks)
        if not n:
            return array("Q")
        slots = self._take_slots(n)
        self._stamp = stamp = self._stamp % _NUM_STAMPS + 1
        expires_us = _us(self._clock() + min(max(lease_s, 0.0), self.max_lease_s))
        code = self._owner_code(owner, n)
        lid_col, block_col, tenant_col = self._lid, self._block, self._tenant
        write_col, owner_col, expires_col = self._write, self._owner, self._expires_us
        high, lids = stamp << _SLOT_BITS, array("Q")
        for slot, block in zip(slots, blocks):
            lid = high | slot
            lid_col[slot], block_col[slot], tenant_col[slot] = lid, block, tenant
            write_col[slot], owner_col[slot], expires_col[slot] = write, code, expires_us
            lids.append(lid)
        self._schedule(expires_us, slots)
        self._per_tenant[tenant] = self._per_tenant.get(tenant, 0) + n
        self._num_live += n
        return lids

    def drop(self, lease_id: int) -> Lease | None:
        """Removes a live lease and returns it; None when there is none by that id."""
        slot = lease_id & _SLOT_MASK
        if slot >= len(self._lid) or self._lid[slot] != lease_id:
            return None
        lease = self._free_slot(slot)
        self._maybe_compact()
        return lease

    def pop_expired(self, limit: int) -> list[Lease]:
        """Drops and returns the leases whose time has come, looking at `limit` slots at most
        (the rest wait for the next call). Usually none: one comparison."""
        now_us, order, out = _us(self._clock()), self._due_order, []
        lid, expires = self._lid, self._expires_us
        while order and order[0] <= now_us and limit > 0:
            due_us = order[0]
            bucket = self._due[due_us]
            take = min(limit, len(bucket))
            slots = bucket[len(bucket) - take:]
            del bucket[len(bucket) - take:]
            if not bucket:
                heapq.heappop(order)
                del self._due[due_us]
            limit -= take
            self._num_due -= take
            out.extend(self._free_slot(slot) for slot in slots if lid[slot] and expires[slot] == due_us)
        if out:
            self._maybe_compact()
        return out

    def _schedule(self, due_us: int, slots: list[int]) -> None:
        """Files `slots` (live leases) under their expiry time `due_us`."""
        bucket = self._due.get(due_us)
        if bucket is None:
            self._due[due_us] = array("i", slots)
            heapq.heappush(self._due_order, due_us)
        else:
            bucket.extend(slots)
        self._num_due += len(slots)

    def drop_owner(self, owner: Hashable) -> list[Lease]:
        """Drops and returns every live lease taken on `owner`."""
        code = self._owner_codes.get(owner)
        if code is None:
            return []
        mine = list(itertools.compress(range(len(self._owner)), map(code.__eq__, self._owner)))
        out = [self._free_slot(slot) for slot in mine]
        self._maybe_compact()
        return out

    # ---- slots ------------------------------------------------------------------------------

    def _take_slots(self, n: int) -> list[int]:
        """`n` free slots: given-back ones first (lowest first after a compaction), then new ones."""
        reused = min(n, len(self._free))
        slots = self._free[len(self._free) - reused:].tolist()[::-1]
        del self._free[len(self._free) - reused:]
        fresh = n - reused
        if fresh:
            top = len(self._lid)
            slots.extend(range(top, top + fresh))
            for column in (self._lid, self._block, self._tenant, self._owner, self._expires_us):
                column.frombytes(bytes(column.itemsize * fresh))
            self._write.extend(bytes(fresh))
        return slots

    def _free_slot(self, slot: int) -> Lease:
        lease = Lease(self._block[slot], self._tenant[slot], bool(self._write[slot]))
        self._lid[slot] = 0
        self._per_tenant[lease.tenant] -= 1
        code = self._owner[slot]
        self._owner[slot] = _NO_OWNER  # `drop_owner` finds live slots only
        if code != _NO_OWNER:
            left = self._per_owner[code] - 1
            if left:
                self._per_owner[code] = left
            else:
                del self._per_owner[code]
                del self._owner_codes[self._owner_keys.pop(code)]
        self._free.append(slot)
        self._num_live -= 1
        self._drops_since_compact += 1
        return lease

    def _owner_code(self, owner: Hashable | None, num_leases: int) -> int:
        """`owner`'s code in the `_owner` column, `num_leases` more leases counted against it."""
        if owner is None:
            return _NO_OWNER
        code = self._owner_codes.get(owner)
        if code is None:
            code = self._owner_codes[owner] = self._next_owner
            self._owner_keys[code] = owner
            self._next_owner += 1
        self._per_owner[code] = self._per_owner.get(code, 0) + num_leases
        return code

    def _maybe_compact(self) -> None:
        """Rebuilds the heap and cuts the columns back once most of either is dead weight; the
        cost is linear in the table, paid at most once per quarter of its slots freed."""
        if not self._num_live:
            if len(self._lid) > _COMPACT_SLACK or self._num_due > _COMPACT_SLACK:
                self._reset()  # a small table stays: its next lease needs no new columns
            return
        heap_bloated = self._num_due > 2 * self._num_live + _COMPACT_SLACK
        slots_bloated = (len(self._lid) > 4 * self._num_live + _COMPACT_SLACK
                         and self._drops_since_compact * 4 >= len(self._lid))
        if heap_bloated or slots_bloated:
            self._compact()

    def _compact(self) -> None:
        lid = self._lid
        top = (len(bytes(lid).rstrip(b"\0")) + 7) // 8  # one past the highest live slot
        for column in (lid, self._block, self._tenant, self._owner, self._expires_us):
            del column[top:]
        del self._write[top:]
        self._free = array("i", reversed(list(itertools.compress(range(top), map((0).__eq__, lid)))))
        by_due: dict[int, list[int]] = {}
        expires = self._expires_us
        for slot in itertools.compress(range(top), lid):
            by_due.setdefault(expires[slot], []).append(slot)
        self._due, self._due_order, self._num_due = {}, [], 0
        for due_us, slots in by_due.items():
            self._schedule(due_us, slots)
        self._drops_since_compact = 0
