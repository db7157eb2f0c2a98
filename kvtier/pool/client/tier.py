"""`PoolTier`: the pool nodes as the manager's third tier — `num_slots` slots of `slot_bytes`.

The manager addresses slots, not keys, and writes a block layer by layer into a slot it chose.
So each slot of this process is a *mutable* block on the pool under a key private to this tier
instance (`xxh3_128(instance id, slot)`), allocated on the slot's first write (`alloc`), placed on
its home node by rendezvous hashing, and thereafter read and written one-sided at byte ranges.

Trade-off: blocks stored through this adapter are not shared with other processes — the slot
interface carries no block key, so another process cannot find them; sharing goes through
`PoolClient.put/get` with real block keys. In exchange the manager's model holds exactly: its
index, policies, watermarks and two-phase moves work unchanged, and per-layer loads are range
reads. The pool may still drop a slot (recency eviction under pressure from other clients, a node
restart): a read or write of it then raises `TierIOError`, which the transfer engine turns into a
miss, and the next write allocates the slot afresh. Keep `capacity` within the tenant's quota.
"""

from __future__ import annotations

import logging
import os
import threading

import torch
import xxhash

from kvtier.errors import TierIOError, TierUnavailable, TransferError
from kvtier.pool.client.api import PoolClient, Slot
from kvtier.pool.client.connection import NodeUnavailable
from kvtier.tiers.base import Medium, Tier, TierKind, as_byte_buffer, slots_needed

log = logging.getLogger(__name__)


class PoolTier(Tier):
    """`num_slots` slots on the pool nodes behind `client`.

    Args:
        client: the pool client; closed with the tier when `owns_client`.
        capacity_bytes: this process's share of the pool; rounded down to whole slots.
        slot_bytes: bytes per slot (one block).
    Raises:
        CapacityError: capacity is below one slot.
    """

    kind = TierKind.POOL
    medium = Medium.REMOTE

    def __init__(self, client: PoolClient, capacity_bytes: int, slot_bytes: int, *, owns_client: bool = False) -> None:
        self.slot_bytes = slot_bytes
        self.num_slots = slots_needed(capacity_bytes, slot_bytes, "pool")
        self._client, self._owns_client = client, owns_client
        self._instance = os.urandom(16)
        self._slots: list[Slot | None] = [None] * self.num_slots
        self._lock = threading.Lock()
        self._closed = False

    def write(self, slot: int, src: torch.Tensor, offset: int = 0) -> None:
        """Writes `src` at `offset` of `slot`, allocating the slot on the pool on first use.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the pool has no room, is unreachable, or dropped the slot (its earlier
                content is then lost; the next write starts it afresh).
        """
        src = as_byte_buffer(src, "pool write source")
        self._check_range(slot, offset, src.numel())
        if src.numel() == 0:
            return self._check_open()
        handle = self._slot(slot, allocate=True)
        self._io(slot, handle, lambda: self._client.write_at(handle, offset, _host(src)), "write")

    def read(self, slot: int, dst: torch.Tensor, offset: int = 0) -> None:
        """Reads `dst.numel()` bytes at `offset` of `slot`.

        Raises:
            TypeError, IndexError: as the `Tier` contract.
            TierIOError: the slot was never written here, was dropped by the pool, or the pool is
                unreachable.
        """
        dst = as_byte_buffer(dst, "pool read destination")
        self._check_range(slot, offset, dst.numel())
        if dst.numel() == 0:
            return self._check_open()
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
                 "tenant": self._client.tenant, "sharing": "per process (slot adapter)"}
        rdma = [t for t in self._client.transports if t.name == "rdma"]
        if rdma:  # zero copy from the DRAM slab; its byte counters show which path blocks took
            errors = sorted({t.zero_copy_error for t in rdma if t.zero_copy_error})
            facts["rdma_zero_copy"] = "off: " + "; ".join(errors) if errors else "on"
            facts["rdma_zero_copy_bytes"] = sum(t.zero_copy_bytes for t in rdma)
            facts["rdma_staged_bytes"] = sum(t.staged_bytes for t in rdma)
        return facts

    def close(self) -> None:
        """Frees this tier's blocks on the pool (best effort) and closes the client if owned. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            held = [s for s in self._slots if s is not None]
            self._slots = [None] * self.num_slots
        try:
            self._client.free(held)
        finally:
            if self._owns_client:
                self._client.close()

    # ---- internals ----------------------------------------------------------------------------

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
        tier = PoolTier(client, cfg.capacity_bytes, slot_bytes, owns_client=True)
        for facts in client.stats():
            if "error" in facts:
                log.warning("tiers.pool: node %s unreachable for now: %s", facts["address"], facts["error"])
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
