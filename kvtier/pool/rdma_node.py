"""The node's side of the RDMA data plane: its device, one memory region per store region, and one
RC queue pair per client connection that asked for one (RDMA_CONNECT).

Each store region is registered on its own so that a tenant is told the `(addr, rkey)` of its own
regions only. Known limit: a region handed to another tenant keeps its rkey, so a client that
learned it earlier could still reach it; re-registering on hand-over (or memory windows) closes that.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any

from kvtier.pool.arena import Arena
from kvtier.pool.store import BlockStore
from kvtier.pool.verbs import Device, PeerInfo, QueuePair, load_verbs


class RdmaNode:
    """Owns the node's verbs device, its MRs and the queue pairs of connected clients.

    Raises (constructor):
        NoRDMADevice: no device can be opened.
    """

    def __init__(self, arena: Arena, store: BlockStore) -> None:
        self.device = Device(load_verbs())
        self._store = store
        base = ctypes.addressof(ctypes.c_char.from_buffer(arena.view))
        self._mrs = [self.device.register(r.size, base + r.base) for r in store.regions]
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
