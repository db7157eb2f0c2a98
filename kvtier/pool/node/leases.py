"""The leases of one node's blocks, sans-I/O: ids, expiry, and how many each holder may have.

A lease keeps a block busy (never evicted, deleted or reused) until it is released or expires.
Each lease counts against its tenant and, when it was taken on a connection (`owner`), against
that connection, so that no client — a flood of GETs that never release, say — can make the node
hold unbounded memory or slow down everyone's requests; what a connection held is dropped when it
closes. `BlockStore` keeps the blocks' busy counts; this table only keeps the leases.

Expiry is a heap of (expiry time, lease id). A lease released early stays in the heap until its
time comes; the heap is rebuilt from the live leases when it grows much larger than them, so
releasing leases gives their memory back at once.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from kvtier.pool.node.blocks import Block

_COMPACT_SLACK = 1024  # heap entries beyond twice the live leases before the heap is rebuilt


@dataclass(slots=True)
class Lease:
    block: Block
    expires_at: float
    write: bool
    owner: Hashable | None


class LeaseTable:
    """Live leases by id, by tenant and by owner. Not thread-safe (the store's caller locks).

    Args:
        clock: seconds, monotonic.
        max_lease_s: the longest lease granted, whatever is asked for.
        max_per_owner, max_per_tenant: the most live leases one owner (connection) or one tenant holds.
        id_base: the first lease id minus one.
    """

    def __init__(self, clock: Callable[[], float], max_lease_s: float, max_per_owner: int,
                 max_per_tenant: int, id_base: int = 0) -> None:
        self._clock, self.max_lease_s = clock, max_lease_s
        self.max_per_owner, self.max_per_tenant = max_per_owner, max_per_tenant
        self._next_id = id_base
        self._live: dict[int, Lease] = {}
        self._expiry: list[tuple[float, int]] = []
        self._per_tenant: dict[str, int] = {}
        self._by_owner: dict[Hashable, set[int]] = {}

    def __len__(self) -> int:
        return len(self._live)

    @property
    def heap_entries(self) -> int:
        """Entries in the expiry heap, released leases not yet compacted away included."""
        return len(self._expiry)

    def count(self, tenant: str) -> int:
        return self._per_tenant.get(tenant, 0)

    def room(self, tenant: str, owner: Hashable | None) -> int:
        """How many more leases `tenant` may take on `owner` (None: no owner bound) now."""
        left = self.max_per_tenant - self._per_tenant.get(tenant, 0)
        if owner is not None:
            left = min(left, self.max_per_owner - len(self._by_owner.get(owner, ())))
        return max(left, 0)

    def get(self, lease_id: int) -> Lease | None:
        return self._live.get(lease_id)

    def add(self, block: Block, lease_s: float, write: bool, owner: Hashable | None) -> int:
        """A new lease on `block` for `min(lease_s, max_lease_s)`; returns its id. The caller has
        checked `room` (this table does not refuse)."""
        self._next_id += 1
        lid = self._next_id
        expires = self._clock() + min(max(lease_s, 0.0), self.max_lease_s)
        self._live[lid] = Lease(block, expires, write, owner)
        heapq.heappush(self._expiry, (expires, lid))
        self._per_tenant[block.tenant] = self._per_tenant.get(block.tenant, 0) + 1
        if owner is not None:
            self._by_owner.setdefault(owner, set()).add(lid)
        return lid

    def drop(self, lease_id: int) -> Lease | None:
        """Removes a live lease and returns it; None when there is none by that id."""
        lease = self._live.pop(lease_id, None)
        if lease is None:
            return None
        self._per_tenant[lease.block.tenant] -= 1
        if lease.owner is not None:
            owned = self._by_owner[lease.owner]
            owned.discard(lease_id)
            if not owned:
                del self._by_owner[lease.owner]
        if len(self._expiry) > 2 * len(self._live) + _COMPACT_SLACK:
            self._expiry = [(lease.expires_at, lid) for lid, lease in self._live.items()]
            heapq.heapify(self._expiry)
        return lease

    def pop_expired(self) -> list[Lease]:
        """Drops and returns every lease whose time has come (usually none: one comparison)."""
        now = self._clock()
        if not self._expiry or self._expiry[0][0] > now:
            return []
        out = []
        while self._expiry and self._expiry[0][0] <= now:  # re-read: `drop` may rebuild the heap
            lease = self.drop(heapq.heappop(self._expiry)[1])
            if lease is not None:
                out.append(lease)
        return out

    def owned_by(self, owner: Hashable) -> list[int]:
        """The ids of the live leases taken on `owner`."""
        return list(self._by_owner.get(owner, ()))
