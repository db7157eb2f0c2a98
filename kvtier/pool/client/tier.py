"""`PoolTier`: the pool nodes as the manager's pool tier — `num_slots` slots of `slot_bytes`, shared by key.

The keyed-store skeleton (binding slots to keys, gathering layer spans, deduplication, the
negative cache, waiting for a peer's put, batches failing by index) is `SharedTier`'s; this class
fills in the pool's calls, each one per node for a whole batch (`PoolClient`):

    put     a header of per-chunk checksums and the bytes (`streamed.BlockFrame`; large blocks
            only), committed by the node only against the object's key-seeded checksum, so no
            process sees it before it is whole and checked. Over TCP one pipelined burst of PUT
            frames per node (one round trip); over RDMA one PUT_BEGIN, one chain of work requests
            and one PUT_COMMIT per node.
    get     one GET per node for the whole blocks of a batch, each straight into the caller's
            memory (a framed block's header into scratch), checked against its checksum by the
            client (a block the node dropped or that fails its check is a `TierIOError`: a miss,
            never wrong bytes). A read of part of a block (a layer range) starts one streamed get
            of the whole block and returns as soon as its range is in and checked chunk by chunk
            (`streamed.StreamedRead`): layer by layer from the pool; the other ranges' reads take
            theirs from the same get.
    find    one CONTAINS per node for the keys asked.

The node's recency eviction, leases and quotas stay the authority over shared blocks: this tier
never deletes one (another process may be reading it), and one the node evicted is a miss here.

A key of any other type cannot be found by another process; such blocks get a mutable block under
a key private to this tier instance (`xxh3_128(instance id, slot)`), allocated one ALLOC per node
for a batch, written and read one-sided at byte ranges (one batch of accesses per node), and
deleted when the tier closes. Either way the pool may drop a block (recency eviction under
pressure from other clients, a node restart): the read then fails with `TierIOError`, which the
transfer engine turns into a miss. Keep `capacity` within the tenant's quota.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvtier.errors import TierIOError, TierUnavailable, TransferError
from kvtier.pool.client.api import PoolClient, Slot
from kvtier.pool.client.connection import NodeUnavailable
from kvtier.pool.client.hint_sender import HintSender
from kvtier.pool.client.streamed import BlockFrame, StreamedRead, run_many
from kvtier.pool.protocol import GrantStatus
from kvtier.observing.stats import Stats
from kvtier.tiers.base import LayerSums, Tier, copy_bytes
from kvtier.tiers.shared import NEGATIVE_CACHE_S, STORED, Put, PutResult, SharedTier

log = logging.getLogger(__name__)


_READ_CACHE_BLOCKS = 64  # blocks kept between the partial reads of one, at least a batch's (see `_read_parts`)
_FETCH_THREADS = 8  # batches of streamed reads at once
_REFUSALS = {None: "its node did not answer", GrantStatus.FULL: "no room: every block there is being read",
             GrantStatus.QUOTA: "the tenant's quota is spent"}


class PoolTier(SharedTier):
    """`num_slots` slots on the pool nodes behind `client`, shared by key (see the module docstring).

    Args:
        client: the pool client; closed with the tier when `owns_client`.
        capacity_bytes: this process's share of the pool; rounded down to whole slots.
        slot_bytes: bytes per slot (one block).
        shared: keep `BlockKey` blocks under their keys, for every process of the tenant (False:
            every block under a key private to this tier, as for other keys).
        negative_cache_s: how long a key found absent is not asked for again.
        stats: where the shared-tier counters go (`Stats.shared`); the runtime passes its own.

    Set `writes_shared` (see `SharedTier`) False where a peer process sends the shared blocks:
    writes of them are then counted `left_to_peer` and send nothing.
    Raises:
        CapacityError: capacity is below one slot.
    """

    def __init__(self, client: PoolClient, capacity_bytes: int, slot_bytes: int, *, owns_client: bool = False,
                 shared: bool = True, negative_cache_s: float = NEGATIVE_CACHE_S, stats: Stats | None = None) -> None:
        super().__init__(capacity_bytes, slot_bytes, shared=shared, negative_cache_s=negative_cache_s, stats=stats,
                         peer_timeout_s=client.timeout_s)
        self._client, self._owns_client = client, owns_client
        self._slots: list[Slot | None] = [None] * self.num_slots  # private mutable blocks
        self._reads: OrderedDict[tuple[int, bytes], StreamedRead] = OrderedDict()  # see `_read_parts`
        self._frame = BlockFrame(slot_bytes)
        self._fetcher: ThreadPoolExecutor | None = None  # runs the streamed reads, started on first use
        # A streamed read may queue behind others on the fetch threads; each of its calls has the
        # client's timeout, so this only guards against a bug, never ends a slow read.
        self._fetch_timeout_s = 60 + 10 * client.timeout_s
        self.hints = HintSender(client)  # RETAIN / RELEASE_HINT, sent off the caller's thread

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
        """The client's counters and, as `hint_*`, what became of the retention hints passed on."""
        return {**self._client.counters, **{f"hint_{name}": n for name, n in self.hints.counts.items()}}

    def hint(self, retain: list[bytes], retain_s: float, release: list[bytes]) -> None:
        """Queued for the nodes (`HintSender`): RETAIN of `retain`, RELEASE_HINT of `release`. Where a
        peer writes the shared blocks (`writes_shared` False) the peer, which applies the same hint
        to the same keys, sends it: nothing is sent twice."""
        if self.writes_shared:
            self.hints.send(retain, retain_s, release)

    def announce(self, keys: list[bytes], hashes: list[int | bytes], *, block_size: int,
                 parents: list[int | bytes | None], tokens: list[Sequence[int]]) -> dict[str, int]:
        """Names shared blocks this tier put with the engine's block hashes, so their nodes publish
        the tenant's KV events for them (`PoolClient.announce`: returns its counts, raises as it).

        Raises:
            TierIOError: the tier is closed.
        """
        with self._lock:
            self._check_open()
        return self._client.announce(keys, hashes, block_size=block_size, parents=parents, tokens=tokens)

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

    # ---- the keyed store (`SharedTier`) ------------------------------------------------------

    def _put(self, keys: list[bytes], blocks: list[torch.Tensor]) -> list[PutResult]:
        """One put per node for the batch, each block behind a header of per-chunk checksums for
        readers that stream it (large blocks only), committed by the node only against the
        object's key-seeded checksum."""
        framed = [(memoryview(self._frame.header(k, b)), b.numpy()) for k, b in zip(keys, blocks)] \
            if self._frame.framed else blocks
        out = []
        for status in self._client.batch_put_status(keys, framed):
            if status in (GrantStatus.GRANTED, GrantStatus.EXISTS):
                out.append(STORED)
            elif status is GrantStatus.BUSY:
                out.append(PutResult(Put.BUSY))
            else:
                out.append(PutResult(Put.REFUSED, _REFUSALS.get(status, getattr(status, "name", str(status)))))
        return out

    def _get(self, keys: list[bytes], intos: list[torch.Tensor], sums: list[LayerSums | None]) -> list[str | None]:
        """One GET per node for the batch, each block straight into its buffer (a framed block's
        header into scratch, its format checked), checked as a whole (nothing chunk by chunk)
        unless the caller checks it (`sums`), whose layers are then hashed as they land."""
        size = self._frame.header_bytes
        scratch = memoryview(bytearray(len(keys) * size))  # a bytearray: ~0.2 µs, a tensor ~5
        headers = [scratch[j * size: (j + 1) * size] for j in range(len(keys))]
        framed = [False] * len(keys)

        def parts(j: int, length: int):
            got = self._frame.parts(headers[j], intos[j], length, chunked=False)
            framed[j] = got is not None and len(got) > 1
            return got

        hits = self._client.get_streamed_many(keys, parts, checks_parts=lambda j, _: sums[j] is not None,
                                              summed=lambda j, part: sums[j] if part == (1 if framed[j] else 0) else None)
        return [None if hit and (not framed[j] or self._frame.is_header(headers[j])) else
                "not on the pool any more (evicted, node down or restarted) or failed its checksum"
                for j, hit in enumerate(hits)]

    def _contains(self, keys: list[bytes]) -> list[bool]:
        return self._client.contains(keys)

    def _failure(self, key: bytes) -> type[TierIOError]:
        node = self._client.home(key)
        return TierUnavailable if self._client.links[node].down and all(l.down for l in self._client.links) \
            else TierIOError

    def _read_parts(self, slots: list[int], keys: list[bytes], offset: int,
                    dsts: list[torch.Tensor]) -> dict[int, Exception]:
        """Ranges of blocks (layer ranges of a load that reports layers as they land): the blocks of
        the batch are fetched whole once, one streamed get per node on a fetch thread; a range is
        copied out as soon as it is in and checked (`StreamedRead`), so the first layers of a
        block are delivered while its last are still on the wire, and the later ranges' reads
        take theirs from the same get."""
        try:
            fetches = self._fetches(slots, keys)
        except TierIOError as e:  # closed
            return {j: e for j in range(len(slots))}
        failed: dict[int, Exception] = {}
        for j, (slot, key, fetch, dst) in enumerate(zip(slots, keys, fetches, dsts)):
            try:
                self._take_range(slot, key, fetch, dst, offset)
            except TierIOError as e:
                failed[j] = e
        return failed

    def _take_range(self, slot: int, key: bytes, fetch: StreamedRead, dst: torch.Tensor, offset: int) -> None:
        n = dst.numel()
        try:
            fetch.wait(offset + n, self._fetch_timeout_s)
        except TierIOError as e:
            self._drop_fetch(slot, key, fetch)
            self._memory.forget(key)
            raise self._failure(key)(f"POOL slot {slot}: {e}") from None
        copy_bytes(dst, fetch.block[offset: offset + n])  # one thread's memcpy (see `copy_bytes`)
        if offset + n == self.slot_bytes:  # the last range: the next load of this slot fetches afresh
            self._drop_fetch(slot, key, fetch)

    def _drop_fetch(self, slot: int, key: bytes, fetch: StreamedRead) -> None:
        with self._lock:
            if self._reads.get((slot, key)) is fetch:
                del self._reads[(slot, key)]

    def _fetches(self, slots: list[int], keys: list[bytes]) -> list[StreamedRead]:
        """The fetch of each slot's block in progress or done, else a new one: those are started
        together, one streamed get per node for them all (`run_many`), on a fetch thread."""
        with self._lock:
            self._check_open()
            out, fresh = [], []
            for slot, key in zip(slots, keys):
                fetch = self._reads.get((slot, key))
                if fetch is None or fetch.failed:
                    fetch = self._reads[(slot, key)] = StreamedRead(self._frame, key)
                    fresh.append(fetch)
                out.append(fetch)
            while len(self._reads) > max(_READ_CACHE_BLOCKS, len(slots)):
                self._reads.popitem(last=False)
            if fresh:
                if self._fetcher is None:
                    self._fetcher = ThreadPoolExecutor(_FETCH_THREADS, thread_name_prefix="kvtier-pool-fetch")
                self._fetcher.submit(run_many, fresh, self._client.get_streamed_many)
        return out

    # ---- private blocks ----------------------------------------------------------------------

    def _write_private(self, slots: list[int], offset: int, srcs: list[torch.Tensor]) -> dict[int, Exception]:
        """One-sided writes at byte ranges of mutable blocks, allocated on a slot's first use
        (one ALLOC per node for the batch); one batch of writes per node."""
        return self._access(slots, offset, srcs, write=True)

    def _read_private(self, slots: list[int], offset: int, dsts: list[torch.Tensor]) -> dict[int, Exception]:
        return self._access(slots, offset, dsts, write=False)

    def _access(self, slots: list[int], offset: int, buffers: list[torch.Tensor], write: bool) -> dict[int, Exception]:
        handles, failed = self._handles(slots, allocate=write)
        todo = [j for j in range(len(slots)) if j not in failed]
        if not todo:
            return failed
        results = self._client.access_many([handles[j] for j in todo], offset, [buffers[j] for j in todo],
                                           write=write)
        for j, result in zip(todo, results):
            if result is not True:
                failed[j] = self._lost(slots[j], handles[j], result, "write" if write else "read")
        return failed

    def _handles(self, slots: list[int], allocate: bool) -> tuple[dict[int, Slot], dict[int, Exception]]:
        """Each slot's mutable block, allocated where `allocate` and it has none (one ALLOC per
        node); the slots without one fail by index."""
        with self._lock:
            self._check_open()
            handles = {j: self._slots[slot] for j, slot in enumerate(slots) if self._slots[slot] is not None}
        missing = [j for j in range(len(slots)) if j not in handles]
        if not missing:
            return handles, {}
        if not allocate:
            return handles, {j: TierIOError(f"POOL slot {slots[j]}: holds no block (never written, or dropped "
                                            "by the pool)") for j in missing}
        keys = [self._private_key(slots[j]) for j in missing]
        failed: dict[int, Exception] = {}
        for j, key, got in zip(missing, keys, self._client.alloc_many(keys, self.slot_bytes)):
            if isinstance(got, Slot):
                handles[j] = got
            else:
                failed[j] = self._error(got, self._client.home(key))(f"POOL slot {slots[j]}: {got}")
        with self._lock:
            self._check_open()
            for j in handles.keys() & set(missing):
                self._slots[slots[j]] = handles[j]
        return handles, failed

    def _lost(self, slot: int, handle: Slot, result: bool | TransferError, verb: str) -> TierIOError:
        """The error of a failed access to private `slot`; the slot is forgotten unless its node
        did not answer (it may still hold the slot: kept for its return)."""
        if isinstance(result, TransferError):
            reason, error = str(result), self._error(result, handle.node)
            unreachable = isinstance(result, NodeUnavailable)
        else:
            reason, error, unreachable = "the pool dropped the slot (evicted or node restarted)", TierIOError, False
        if not unreachable:
            with self._lock:
                if self._slots[slot] is handle:
                    self._slots[slot] = None
        return error(f"POOL slot {slot}: {verb} failed: {reason}")

    def _error(self, e: TransferError, node: int) -> type[TierIOError]:
        """TierUnavailable when `e` says node `node` does not answer and no other node does
        either (the tier failed as a whole); else a failure of this slot only, since the other
        nodes serve the rest."""
        links = self._client.links
        if isinstance(e, NodeUnavailable) and all(link.down for i, link in enumerate(links) if i != node):
            return TierUnavailable
        return TierIOError

    def _close_store(self) -> None:
        """Frees this tier's private blocks on the pool (best effort; shared blocks stay for the
        other processes, the node evicts them by recency) and closes the client if owned."""
        with self._lock:
            held = [s for s in self._slots if s is not None]
            self._slots = [None] * self.num_slots
            self._reads.clear()
            fetcher, self._fetcher = self._fetcher, None
        if fetcher is not None:  # each fetch ends within the client's timeouts
            fetcher.shutdown(wait=True)
        self.hints.close(2 * self._client.timeout_s)  # what is queued goes first, within its calls' time
        try:
            self._client.free(held)
        finally:
            if self._owns_client:
                self._client.close()


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
