"""`PoolTier`: the pool nodes as the manager's pool tier — `num_slots` slots of `slot_bytes`, shared by key.

The manager addresses slots; the transfer engine tells this tier which block each slot holds
(`bind`). A block whose key is a `BlockKey` (16 bytes, naming model, weights, KV format, block
size and tenant) is kept on the pool under that key, where every process and server of the tenant
finds it (`find`, which `KVTier.lookup` asks for the keys it does not index):

    write   the block's bytes, gathered until the whole block is in (spans of a store come layer
            range by layer range), then one keyed put of a header of per-chunk checksums and the
            bytes (`streamed.BlockFrame`), committed by the node only against the object's
            key-seeded checksum, so no process sees it before it is whole and checked. A put
            answered BUSY (another process storing the same block now) waits for that one.
            A block this tier saw on the pool already (found, or put before) is asked for
            instead (CONTAINS) and not sent again if the node still holds it: deduplicated.
    read    a keyed get of the whole block, checked against its checksum by the client (a block
            the node dropped or that fails its check is a `TierIOError`: a miss, never wrong
            bytes). A read of part of a block (a layer range) starts one streamed get of the
            whole block and returns as soon as its range is in and checked chunk by chunk
            (`streamed.StreamedRead`): layer by layer from the pool; the other ranges' reads
            take theirs from the same get.
    find    one CONTAINS per node for the keys asked, behind a short negative cache, so a miss
            asked again at once costs nothing.

The node's recency eviction, leases and quotas stay the authority over shared blocks: this tier
never deletes one (another process may be reading it), and one the node evicted is a miss here.

A key of any other type cannot be found by another process; such blocks get a mutable block under
a key private to this tier instance (`xxh3_128(instance id, slot)`), written and read one-sided at
byte ranges, and deleted when the tier closes. Either way the pool may drop a block (recency
eviction under pressure from other clients, a node restart): the read then raises `TierIOError`,
which the transfer engine turns into a miss. Keep `capacity` within the tenant's quota.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
import xxhash

from kvtier.errors import TierIOError, TierUnavailable, TransferError
from kvtier.keys import KEY_BYTES
from kvtier.pool.client.api import PoolClient, Slot
from kvtier.pool.client.connection import NodeUnavailable
from kvtier.pool.client.streamed import BlockFrame, StreamedRead
from kvtier.pool.protocol import GrantStatus
from kvtier.pool.shared_keys import KeyMemory, SpanGather
from kvtier.stats import Stats
from kvtier.tiers.base import Medium, Tier, TierKind, as_byte_buffer, copy_bytes, slots_needed

log = logging.getLogger(__name__)


NEGATIVE_CACHE_S = 1.0  # how long a key the pool did not hold is answered "absent" without asking
_READ_CACHE_BLOCKS = 64  # blocks kept between the partial reads of one (see `_read_shared`)
_FETCH_THREADS = 8  # streamed reads at once (the transfer engine reads one range per block at a time)


class PoolTier(Tier):
    """`num_slots` slots on the pool nodes behind `client`, shared by key (see the module docstring).

    Args:
        client: the pool client; closed with the tier when `owns_client`.
        capacity_bytes: this process's share of the pool; rounded down to whole slots.
        slot_bytes: bytes per slot (one block).
        shared: keep `BlockKey` blocks under their keys, for every process of the tenant (False:
            every block under a key private to this tier, as for other keys).
        negative_cache_s: how long a key found absent is not asked for again.
        stats: where the shared-tier counters go (`Stats.shared`); the runtime passes its own.

    Set `writes_shared` (see `Tier`) False where a peer process sends the shared blocks: writes of
    them are then counted `left_to_peer` and send nothing.
    Raises:
        CapacityError: capacity is below one slot.
    """

    kind = TierKind.POOL
    medium = Medium.REMOTE
    checks_reads = True  # a keyed get checks the block's key-seeded checksum
    may_drop = True  # the nodes evict by their own recency (see `Tier.may_drop`)

    def __init__(self, client: PoolClient, capacity_bytes: int, slot_bytes: int, *, owns_client: bool = False,
                 shared: bool = True, negative_cache_s: float = NEGATIVE_CACHE_S, stats: Stats | None = None) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, "pool")
        self.shared = shared
        self.stats = stats or Stats()
        self._client, self._owns_client = client, owns_client
        self._instance = os.urandom(16)
        self._slots: list[Slot | None] = [None] * self.num_slots  # private mutable blocks
        self._keys: list[bytes | None] = [None] * self.num_slots  # the shared key each slot holds, if any
        self._gather = SpanGather(slot_bytes)
        self._reads: OrderedDict[tuple[int, bytes], StreamedRead] = OrderedDict()  # see `_read_shared`
        self._frame = BlockFrame(slot_bytes)
        self._fetcher: ThreadPoolExecutor | None = None  # runs the streamed reads, started on first use
        # A streamed read may queue behind others on the fetch threads; each of its calls has the
        # client's timeout, so this only guards against a bug, never ends a slow read.
        self._fetch_timeout_s = 60 + 10 * client.timeout_s
        self._memory = KeyMemory(4 * self.num_slots, negative_cache_s)
        self._lock = threading.Lock()
        self._closed = False

    def can_share(self, key: Hashable) -> bool:
        return self.shared and isinstance(key, bytes) and len(key) == KEY_BYTES

    def bind(self, slot: int, key: Hashable) -> None:
        """Slot `slot` holds block `key`: a `BlockKey` makes it a shared block, anything else a private one."""
        shared = self.can_share(key)
        with self._lock:
            self._keys[slot] = bytes(key) if shared else None

    def find(self, keys: Sequence[Hashable]) -> list[bool]:
        """Whether the pool holds each key (a node down: absent), one CONTAINS per node for the
        keys not answered from the negative cache; keys that cannot be shared are absent."""
        with self._lock:
            self._check_open()
        candidates = [i for i, key in enumerate(keys) if self.can_share(key)]
        shared = [bytes(keys[i]) for i in candidates]
        ask = self._memory.to_ask(shared)
        asked = [shared[j] for j in ask]
        found = self._client.contains(asked) if asked else []
        self._memory.answered(asked, found)
        out = [False] * len(keys)
        for j, hit in zip(ask, found):
            out[candidates[j]] = bool(hit)
        self.stats.count_shared({"asked": len(ask), "found": sum(out), "negative_cached": len(shared) - len(ask)})
        return out

    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Writes `src` at `offset` of `slot`: a shared block once all its bytes are in (see the
        module docstring), a private one at once, allocated on the slot's first use.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the pool has no room, is unreachable, or dropped the slot (its earlier
                content is then lost; the next write starts it afresh).
        """
        src = as_byte_buffer(src, "pool write source")
        self._check_range(slot, offset, src.numel())
        if src.numel() == 0:
            return self._check_open()
        key = self._key(slot)
        if key is not None:
            return self._write_shared(slot, key, _host(src), offset)
        handle = self._slot(slot, allocate=True)
        self._io(slot, handle, lambda: self._client.write_at(handle, offset, _host(src)), "write")

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes at `offset` of `slot`.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the slot was never written here, was dropped by the pool, failed its
                checksum, or the pool is unreachable.
        """
        dst = as_byte_buffer(dst, "pool read destination")
        self._check_range(slot, offset, dst.numel())
        if dst.numel() == 0:
            return self._check_open()
        key = self._key(slot)
        if key is not None:
            return self._read_shared(slot, key, dst, offset)
        handle = self._slot(slot, allocate=False)
        if dst.is_cuda:
            host = torch.empty(dst.numel(), dtype=torch.uint8)
            self._io(slot, handle, lambda: self._client.read_at(handle, offset, host), "read")
            dst.copy_(host)
        else:
            self._io(slot, handle, lambda: self._client.read_at(handle, offset, dst), "read")

    def register_host_memory(self, memory: torch.Tensor) -> None:
        """Host memory (the DRAM tier's slab) goes to the client: over RDMA, blocks then move
        between it and the pool with no staging copy. Device memory is not registered here."""
        if not memory.is_cuda and memory.numel():
            self._client.register_memory(memory.data_ptr(), memory.numel() * memory.element_size(), memory)

    def probe(self) -> None:
        """Asks every node for its stats, those marked down included; succeeds once one answers.

        Raises:
            TierUnavailable: no node answered; the message has each node's error.
        """
        for link in self._client.links:
            link.revive()
        facts = self._client.stats()
        if facts and all("error" in f for f in facts):
            raise TierUnavailable("POOL tier: no node answers: " + "; ".join(f"{f['address']}: {f['error']}"
                                                                              for f in facts))

    @property
    def stored_bytes(self) -> int:
        """The most a block of this tier takes on a node (a shared block with its header)."""
        return self._frame.stored_bytes if self.shared else self.slot_bytes

    def client_counters(self) -> dict[str, int]:
        return self._client.counters

    def describe(self) -> dict[str, object]:
        """The base facts plus nodes, tenant, and the data plane in use with its reason (per node
        when the nodes differ)."""
        facts = self._client.transport_facts()
        names = [link.name for link in self._client.links]
        if len(set(facts)) == 1:
            transport, reason = facts[0]
        else:
            transport = ", ".join(sorted({name for name, _ in facts}))
            reason = "; ".join(f"{node}: {name} ({why})" for node, (name, why) in zip(names, facts))
        facts = {**super().describe(), "nodes": names, "transport": transport, "transport_reason": reason,
                 "tenant": self._client.tenant, "sharing": "by key, every process of the tenant" if self.shared else "per process"}
        rdma = [t for t in self._client.transports if t.name == "rdma"]
        if rdma:  # zero copy from the DRAM slab; its byte counters show which path blocks took
            errors = sorted({t.zero_copy_error for t in rdma if t.zero_copy_error})
            facts["rdma_zero_copy"] = "off: " + "; ".join(errors) if errors else "on"
            facts["rdma_zero_copy_bytes"] = sum(t.zero_copy_bytes for t in rdma)
            facts["rdma_staged_bytes"] = sum(t.staged_bytes for t in rdma)
        return facts

    def close(self) -> None:
        """Frees this tier's private blocks on the pool (best effort; shared blocks stay for the other
        processes, the node evicts them by recency) and closes the client if owned. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held = [s for s in self._slots if s is not None]
            self._slots = [None] * self.num_slots
            self._gather.clear()
            self._reads.clear()
            fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:  # each fetch ends within the client's timeouts
            fetcher.shutdown(wait=True)
        try:
            self._client.free(held)
        finally:
            if self._owns_client:
                self._client.close()

    # ---- internals: shared blocks --------------------------------------------------------------

    def _key(self, slot: int) -> bytes | None:
        with self._lock:
            self._check_open()
            return self._keys[slot]

    def _write_shared(self, slot: int, key: bytes, src: torch.Tensor, offset: int) -> None:
        if not self.writes_shared:  # a peer process sends this block (`Tier.writes_shared`)
            if offset + src.numel() == self.slot_bytes:
                self.stats.count_shared({"left_to_peer": 1})
            return
        if offset != 0 or src.numel() != self.slot_bytes:  # one span of several: gather the block first
            with self._lock:
                src = self._gather.add(slot, key, src, offset)
            if src is None:
                return
        known = self._memory.held(key)
        # A block seen on the pool is asked for (a few bytes) rather than sent: the node may have
        # evicted it since, and a block written nowhere would be lost.
        if known and self._client.contains([key])[0]:
            self.stats.count_shared({"deduplicated": 1})
            return
        # Behind a header of per-chunk checksums, for readers that stream it (large blocks only).
        block = (memoryview(self._frame.header(key, src)), src.numpy()) if self._frame.framed else src
        status = self._client.batch_put_status([key], [block])[0]
        if status is GrantStatus.BUSY and self._await_peer(key):
            self.stats.count_shared({"awaited_peer": 1})
        elif status not in (GrantStatus.GRANTED, GrantStatus.EXISTS):
            why = "its node did not answer" if status is None else {
                GrantStatus.BUSY: "another process was writing it and did not finish in time",
                GrantStatus.FULL: "no room: every block there is being read",
                GrantStatus.QUOTA: "the tenant's quota is spent"}.get(status, status.name)
            raise self._error_for(key)(f"POOL slot {slot}: the pool did not take block {key.hex()[:16]} ({why})")
        self._memory.note_held(key)

    def _await_peer(self, key: bytes) -> bool:
        """Whether the block another client is writing now (a put answered BUSY: the same prefix
        stored by two engines at once) becomes visible within the client's timeout: then nothing
        needs sending from here. Polls CONTAINS, backing off from 1 ms."""
        deadline, pause = time.monotonic() + self._client.timeout_s, 0.001
        while True:
            if self._client.contains([key])[0]:
                return True
            if time.monotonic() + pause > deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)

    def _read_shared(self, slot: int, key: bytes, dst: torch.Tensor, offset: int) -> None:
        """A whole block into host memory: one get into `dst` itself. A part of one (a layer range
        of a load that reports layers as they land): the block is fetched once, on a fetch
        thread, and this read returns as soon as its range is in and checked (`StreamedRead`),
        so the first layers of a block are delivered while its last are still on the wire."""
        n = dst.numel()
        if offset == 0 and n == self.slot_bytes and not dst.is_cuda:
            header = torch.empty(self._frame.header_bytes, dtype=torch.uint8)
            framed: list[bool] = []

            def parts(length: int):
                # the block as one buffer: one receive, nothing checked chunk by chunk (the get
                # checks the whole object), each part a GIL hand-off the other I/O threads wait on
                got = self._frame.parts(header, dst, length, chunked=False)
                framed.append(got is not None and len(got) > 1)
                return got

            if not (self._client.get_streamed(key, parts)
                    and (not framed[-1] or self._frame.checksums(header) is not None)):
                self._forget(key)
                raise self._error_for(key)(f"POOL slot {slot}: block {key.hex()[:16]} is not on the pool any "
                                           "more (evicted, node down or restarted) or failed its checksum")
            return
        fetch = self._streamed(slot, key)
        try:
            fetch.wait(offset + n, self._fetch_timeout_s)
        except TierIOError as e:
            with self._lock:
                if self._reads.get((slot, key)) is fetch:
                    del self._reads[(slot, key)]
            self._forget(key)
            raise self._error_for(key)(f"POOL slot {slot}: {e}") from None
        copy_bytes(dst, fetch.block[offset: offset + n])  # one thread's memcpy (see `copy_bytes`)
        if offset + n == self.slot_bytes:  # the last range: the next load of this slot fetches afresh
            with self._lock:
                if self._reads.get((slot, key)) is fetch:
                    del self._reads[(slot, key)]

    def _streamed(self, slot: int, key: bytes) -> StreamedRead:
        """The fetch of `slot`'s block in progress or done, else a new one started."""
        with self._lock:
            self._check_open()
            fetch = self._reads.get((slot, key))
            if fetch is not None and not fetch.failed:
                return fetch
            fetch = self._reads[(slot, key)] = StreamedRead(self._frame, key)
            while len(self._reads) > _READ_CACHE_BLOCKS:
                self._reads.popitem(last=False)
            if self._fetcher is None:
                self._fetcher = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="kvtier-pool-fetch")
            self._fetcher.submit(fetch.run, self._client.get_streamed)
        return fetch

    def _forget(self, key: bytes) -> None:
        self._memory.forget(key)

    def _error_for(self, key: bytes) -> type[TierIOError]:
        node = self._client.home(key)
        return TierUnavailable if self._client.links[node].down and all(l.down for l in self._client.links) \
            else TierIOError

    # ---- internals: private blocks -------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierIOError("POOL tier is closed")

    def _slot(self, slot: int, allocate: bool) -> Slot:
        with self._lock:
            self._check_open()
            handle = self._slots[slot]
        if handle is not None:
            return handle
        if not allocate:
            raise TierIOError(f"POOL slot {slot}: holds no block (never written, or dropped by the pool)")
        key = xxhash.xxh3_128_digest(self._instance + slot.to_bytes(8, "little"))
        try:
            handle = self._client.alloc(key, self.slot_bytes)
        except TransferError as e:
            raise self._error(e, self._client.home(key))(f"POOL slot {slot}: {e}") from None
        with self._lock:
            self._check_open()
            self._slots[slot] = handle
        return handle

    def _io(self, slot: int, handle: Slot, op, verb: str) -> None:
        error, unreachable = TierIOError, False
        try:
            if op():
                return
            reason = "the pool dropped the slot (evicted or node restarted)"
        except TransferError as e:
            reason, error, unreachable = str(e), self._error(e, handle.node), isinstance(e, NodeUnavailable)
        if not unreachable:  # a node that did not answer may still hold the slot: keep it for its return
            with self._lock:
                if self._slots[slot] is handle:
                    self._slots[slot] = None
        raise error(f"POOL slot {slot}: {verb} failed: {reason}")

    def _error(self, e: TransferError, node: int) -> type[TierIOError]:
        """TierUnavailable when `e` says node `node` does not answer and no other node does
        either (the tier failed as a whole); else a failure of this slot only, since the other
        nodes serve the rest."""
        links = self._client.links
        if isinstance(e, NodeUnavailable) and all(link.down for i, link in enumerate(links) if i != node):
            return TierUnavailable
        return TierIOError


def build_pool_tier(cfg, slot_bytes: int) -> Tier:
    """The pool tier a `TierConfig` of kind POOL describes, its nodes' credentials checked.

    A node that cannot be reached now is only logged (it may come up later: its slots are misses
    until then); a node that refuses the credentials is a configuration error.

    The data plane follows `cfg.transport` (see `PoolClient`): `rdma` needs a device here and
    nodes that serve RDMA; `auto` takes RDMA per node where both ends can.

    Raises:
        ConfigError: RDMA asked for and this host cannot open a device or a reachable node does not
            serve it (or the backend is Mooncake), a secret file unreadable, or a node refused the tenant.
        CapacityError: capacity below one slot.
    """
    from kvtier.errors import ConfigError
    from kvtier.pool.client.connection import AuthFailed
    from kvtier.pool.detect import TransportKind
    from kvtier.pool.tenants import read_secret

    if cfg.backend.value == "mooncake":
        if cfg.transport is TransportKind.RDMA:
            raise ConfigError("tiers.pool.transport: rdma is not available with the mooncake backend; use auto or tcp")
        from kvtier.pool.mooncake import build_mooncake_tier

        return build_mooncake_tier(cfg, slot_bytes)
    secret = read_secret(cfg.secret, str(cfg.secret_file) if cfg.secret_file else None, "tiers.pool")
    try:
        client = PoolClient(cfg.nodes, tenant=cfg.tenant, secret=secret, timeout_s=cfg.timeout_s,
                            reconnect_s=cfg.reconnect_s, transport=cfg.transport,
                            verbs=cfg.verbs)
    except ConfigError as e:
        raise ConfigError(f"tiers.pool: {e}") from None
    try:
        tier = PoolTier(client, cfg.capacity_bytes, slot_bytes, owns_client=True, shared=cfg.shared,
                        negative_cache_s=cfg.negative_cache_s)
        largest = tier.stored_bytes
        for facts in client.stats():
            if "error" in facts:
                log.warning("tiers.pool: node %s unreachable for now: %s", facts["address"], facts["error"])
            elif facts.get("region_bytes", largest) < largest:  # every put would be refused TOO_LARGE
                raise ConfigError(f"tiers.pool: node {facts['address']} holds blocks of at most "
                                  f"{facts['region_bytes']} bytes (its --region-size); this model's blocks "
                                  f"take {largest} on the pool: start it with a larger --region-size")
            elif cfg.transport is TransportKind.RDMA and facts.get("transport") != TransportKind.RDMA.value:
                raise ConfigError(f"tiers.pool.transport: rdma, but node {facts['address']} serves "
                                  f"{facts.get('transport')} ({facts.get('transport_reason')})")
        log.info("tiers.pool: data plane %s", tier.describe()["transport"])
    except AuthFailed as e:
        client.close()
        raise ConfigError(f"tiers.pool: {e}") from None
    except BaseException:
        client.close()
        raise
    return tier


def _host(src: torch.Tensor) -> torch.Tensor:
    return src.cpu() if src.is_cuda else src
