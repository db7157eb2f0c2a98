"""A connector backend whose blocks every process can see: keyed blocks on `kvtier pool serve` nodes.

kvtier's `PoolTier` addresses slots private to one process (see `kvtier.pool.client.tier`), so a block
another engine stored there cannot be found. This backend goes through `PoolClient`'s keyed API
instead, under the connector's own block keys (which already name the model, KV format, block
size and tenant): any engine of any process or server that reaches the same nodes hits the blocks
any other stored. The process's other tiers (HBM, DRAM, SSD) stay in front as a local `KVTier`:

    lookup   leading keys held locally, then the leading run of the rest found on the pool
    load     local blocks through the `KVTier` (layer by layer); the others fetched whole from the
             pool first, so a load that needs the pool reports its layers once those blocks are in
    store    into the local tiers and onto the pool, both; the handle ends when both have.
             Under tensor parallelism with replicated KV (MLA, or fewer KV heads than ranks),
             ranks holding the same slice share its pool key: only the first of them writes it
             (`write_pool`), the others keep their local copy, so the pool receives each slice once

A node that is down or slow is a miss (`PoolClient` never raises for that), never wrong bytes: a
block's bytes are checked against their checksum on every get.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.cpus import pin_thread
from kvtier.handle import Stage, TransferHandle
from kvtier.keys import BlockKey
from kvtier.layout import BlockLayout
from kvtier.pool.client.api import PoolClient
from kvtier.runtime import KVTier
from kvtier.stats import Stats

log = logging.getLogger(__name__)


class PoolConnectorBackend:
    """The connector's `Backend` over pool nodes, with an optional local `KVTier` in front.

    Args:
        client: keyed access to the pool nodes; closed with the backend.
        layout: the block layout (every block is `layout.block_bytes`).
        local: the process's own tiers, looked up and loaded first; None: the pool only.
        io_workers: threads that run pool calls (one call per load or store).
        write_pool: False on a rank whose slice another rank writes to the pool (see the module
            docstring); its stores go to the local tiers only.
        cpus: the CPUs its threads run on (None: those of the thread that starts them).
    """

    def __init__(self, client: PoolClient, layout: BlockLayout, local: KVTier | None = None,
                 io_workers: int = 2, write_pool: bool = True, cpus: Sequence[int] | None = None) -> None:
        self.client, self.layout, self.local, self.write_pool = client, layout, local, write_pool
        self._io = ThreadPoolExecutor(io_workers, thread_name_prefix="kvtier-vllm-pool",
                                      initializer=lambda: pin_thread(cpus))
        self._closed = False
        self._lock = threading.Lock()
        self._counts = {"hits": 0, "misses": 0, "stores": 0}  # blocks the pool served, missed, took

    def lookup(self, keys: Sequence[BlockKey]) -> int:
        """Leading keys held locally or on the pool; a node that is down holds nothing."""
        n = self.local.lookup(keys) if self.local is not None else 0
        if n == len(keys):
            return n
        found = self.client.contains([bytes(k) for k in keys[n:]])
        return n + next((i for i, hit in enumerate(found) if not hit), len(found))

    def loadable(self, keys: Sequence[BlockKey]) -> int:
        """As `lookup`, the local tiers' blocks slower to load than to recompute left out (the
        pool's own load time is not estimated here: its blocks count as worth loading)."""
        if self.local is None:
            return self.lookup(keys)
        held = self.local.lookup(keys)
        worth = self.local.loadable(keys)
        if worth < held or held == len(keys):
            return worth
        found = self.client.contains([bytes(k) for k in keys[held:]])
        return held + next((i for i, hit in enumerate(found) if not hit), len(found))

    def note_compute(self, num_tokens: int, seconds: float) -> None:
        if self.local is not None:
            self.local.note_compute(num_tokens, seconds)

    def load(self, keys: Sequence[BlockKey], into: torch.Tensor) -> TransferHandle:
        """Loads each block from the fastest place holding it; see the module docstring."""
        rows = [into[i] for i in range(len(keys))]
        where = self.local.where(keys) if self.local is not None else [None] * len(keys)
        here = [i for i, tier in enumerate(where) if tier is not None]
        remote = [i for i, tier in enumerate(where) if tier is None]
        local = self.local.load([keys[i] for i in here], [rows[i] for i in here]) if here else None
        handle = TransferHandle(keys, self.layout.num_layers)
        self._io.submit(self._finish_load, handle, local, [keys[i] for i in remote], [rows[i] for i in remote])
        return handle

    def store(self, keys: Sequence[BlockKey], blocks: torch.Tensor, *, background: bool = False) -> TransferHandle:
        """Stores the blocks locally and on the pool; a block is failed only if both failed. The
        pool's part always runs on this backend's I/O threads."""
        local = self.local.store(keys, blocks, background=background) if self.local is not None else None
        if not self.write_pool:  # another rank writes this slice to the pool
            if local is not None:
                return local
            handle = TransferHandle(keys, self.layout.num_layers)
            handle.finish()
            return handle
        handle = TransferHandle(keys, self.layout.num_layers)
        self._io.submit(self._finish_store, handle, local, list(keys), [blocks[i] for i in range(len(keys))])
        return handle

    def snapshot(self) -> dict[str, object]:
        """The local tiers' `KVTier.snapshot()`, with the pool's blocks (`hits`, `misses` and
        `stores` under tier "pool") and the pool client's own counters (`pool_client`)."""
        snap = self.local.snapshot() if self.local is not None else {
            "usage": {}, **Stats().snapshot(), "unavailable": {}, "store_backlog_bytes": 0}
        with self._lock:
            counts = dict(self._counts)
        snap["hits"] = {**snap["hits"], "pool": counts["hits"]}
        snap["stores"] = {**snap["stores"], "pool": counts["stores"]}
        snap["misses"] += counts["misses"]
        snap["pool_client"] = self.client.counters
        return snap

    def describe(self) -> dict[str, object]:
        """The local tiers' `KVTier.describe()`, with the pool nodes and the data plane to each."""
        info = self.local.describe() if self.local is not None else {
            "block_bytes": self.layout.block_bytes, "block_tokens": self.layout.block_tokens,
            "num_layers": self.layout.num_layers, "tiers": []}
        planes = self.client.transport_facts()
        return {**info, "pool": {"nodes": [link.name for link in self.client.links], "tenant": self.client.tenant,
                                 "transport": ", ".join(sorted({name for name, _ in planes})),
                                 "transport_reason": "; ".join(sorted({why for _, why in planes}))}}

    def close(self) -> None:
        """Waits for the pool calls in flight, then closes the local tiers and the client. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._io.shutdown(wait=True)
        try:
            if self.local is not None:
                self.local.close()
        finally:
            self.client.close()

    # ---- on the I/O threads -------------------------------------------------------------

    def _finish_load(self, handle: TransferHandle, local: TransferHandle | None,
                     keys: list[BlockKey], rows: list[torch.Tensor]) -> None:
        try:
            found = self.client.batch_get([bytes(k) for k in keys], rows) if keys else []
            self._count(hits=sum(map(bool, found)), misses=len(found) - sum(map(bool, found)))
            for key, hit in zip(keys, found):
                if not hit:
                    handle.fail(key, Stage.READ, 0, "not on the pool (or its node is down)")
            for layer in range(self.layout.num_layers):
                if local is not None:
                    local.wait_layer(layer)
                handle.layer_done(layer)
            if local is not None:
                local.wait()
                for key, failure in local.failed.items():
                    handle.fail(key, failure.stage, failure.layer, failure.error)
        except Exception as e:  # a broken call: every block not yet in counts as failed
            log.warning("kvtier pool load of %d blocks failed: %r", len(handle.keys), e)
            for key in handle.keys:
                handle.fail(key, Stage.READ, 0, repr(e))
        handle.finish()

    def _finish_store(self, handle: TransferHandle, local: TransferHandle | None,
                      keys: list[BlockKey], blocks: list[torch.Tensor]) -> None:
        try:
            stored = self.client.batch_put([bytes(k) for k in keys], blocks)
            self._count(stores=sum(map(bool, stored)))
            local_failed = set(keys)
            if local is not None:
                local.wait()
                local_failed = set(local.failed)
            for key, ok in zip(keys, stored):
                if not ok and key in local_failed:
                    handle.fail(key, Stage.WRITE, 0, "stored neither locally nor on the pool")
        except Exception as e:
            log.warning("kvtier pool store of %d blocks failed: %r", len(keys), e)
            for key in keys:
                handle.fail(key, Stage.WRITE, 0, repr(e))
        handle.finish()

    def _count(self, **counts: int) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counts[name] += n
