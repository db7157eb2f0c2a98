"""The node's side of the RDMA data plane: its device, one memory region per store region, and one
RC queue pair per client connection that asked for one (RDMA_CONNECT).

Each store region is registered on its own so that a tenant is told the `(addr, rkey)` of its own
regions only. A region handed to another tenant is registered anew (`rekey`): the old registration
is removed first, so an rkey a client learned earlier dies (its accesses complete with
REM_ACCESS_ERR, which the client turns into misses and a reconnect) before the region is zeroed
and the new tenant's bytes land. Within its own regions a tenant's rkey reaches every byte, free
slots included: only bytes of that tenant, or zeros.
"""

from __future__ import annotations

import threading
from typing import Any

from kvtier.pool.node.arena import Arena
from kvtier.pool.node.blocks import Region
from kvtier.pool.node.store import BlockStore
from kvtier.pool.verbs import Device, PeerInfo, QueuePair, load_verbs


class RdmaNode:
    """Owns the node's verbs device, its MRs and the queue pairs of connected clients.

    Raises (constructor):
        NoRDMADevice: no device can be opened.
    """

    def __init__(self, arena: Arena, store: BlockStore, verbs: str = "pyverbs") -> None:
        self.device = Device(load_verbs(verbs))
        self._store, self._arena = store, arena
        self._mrs = [self.device.register(r.size, arena.address + r.base) for r in store.regions]
        self._qps: dict[Any, QueuePair] = {}
        self._lock = threading.Lock()

    def describe(self) -> str:
        d = self.device
        return f"{d.name} port {d.gid.port} GID index {d.gid.index} ({d.gid.gid}, {d.gid.gid_type.value})"

    def connect(self, owner: Any, tenant: str, header: dict) -> dict:
        """A queue pair for the connection `owner`, connected to the client's; the reply header."""
        qp = QueuePair(self.device)
        try:
            qp.connect(PeerInfo.from_wire(header))
        except BaseException:
            qp.close()
            raise
        with self._lock:
            old = self._qps.pop(owner, None)
            self._qps[owner] = qp
        if old is not None:
            old.close()
        return {**qp.local_info().to_wire(), "regions": self.regions(tenant)}

    def rekey(self, region: Region) -> int:
        """Replaces `region`'s registration as it passes to another tenant (the store's lock held):
        deregister, zero the whole region, register. Whole, not the store's dirty extent: one-sided
        writes reach the free slots too, unseen by the store. Returns the bytes zeroed.

        Raises:
            the verbs' error when the new registration fails; the region's rkey is dead meanwhile
            (its tenant's accesses are misses), and the next hand-over tries again.
        """
        self._mrs[region.id].close()
        self._arena.zero(region.base, region.size)
        self._mrs[region.id] = self.device.register(region.size, self._arena.address + region.base)
        return region.size

    def regions(self, tenant: str) -> list[list[int]]:
        """`[id, addr, rkey, length]` of each region the tenant holds now (the store's lock held)."""
        return [[r.id, mr.buf, mr.rkey, r.size] for r, mr in zip(self._store.regions, self._mrs)
                if r.tenant == tenant]

    def disconnect(self, owner: Any) -> None:
        with self._lock:
            qp = self._qps.pop(owner, None)
        if qp is not None:
            qp.close()

    def close(self) -> None:
        with self._lock:
            qps, self._qps = list(self._qps.values()), {}
        for qp in qps:
            qp.close()
        for mr in self._mrs:
            mr.close()
        self.device.close()
