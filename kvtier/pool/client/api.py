"""`PoolClient`: keyed blocks on one or more pool nodes, shared by every client of a tenant.

A key lives on one node, chosen by rendezvous hashing over the configured node addresses (every
client with the same node list agrees, and losing a node moves only that node's keys): the key's
home is the highest-ranked node that is not marked down. Calls are batched per node, nodes run in
parallel, and every call has a timeout.

Each node's share of a call is one batch of `NodeCalls` (`kvtier.pool.client.node_calls`): a put
or a get in one round trip over TCP, as a raw socket, or under leases with one-sided accesses
over RDMA; every block checked against its key-seeded xxh3-64 (`block_checksum`).

Faults are misses, never errors and never wrong bytes: a node that is down, slow or dies mid-call
yields False for its keys; a block whose bytes do not match their checksum is a miss. A wrong
tenant secret is not a fault but a configuration error, and raises `AuthFailed`.

Data plane per node (`transport`): `tcp`; `rdma` (this host must open an RDMA device, and a node
that does not serve RDMA refuses it loudly: its accesses raise `TransferError`); or `auto`, which
picks RDMA for a node once that node's welcome says it serves RDMA and this host can open a device,
TCP otherwise. The choice and its reason are kept per node (`transport_facts`), never swapped later.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import xxhash

from kvtier.errors import ConfigError, TransferError
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.buffers import byte_view
from kvtier.pool.client.connection import AuthFailed, NodeLink, NodeUnavailable
from kvtier.pool.client.events import EventStream, announce_by_home
from kvtier.pool.client.hints import hint_by_home
from kvtier.pool.client.node_calls import STORED, NodeCalls, grant_status
from kvtier.pool.detect import TransportKind, choose_transport
from kvtier.pool.protocol import MAX_BATCH, GrantStatus, MsgType
from kvtier.pool.client.tcp import TCPTransport
from kvtier.units import parse_address

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Slot:
    """A mutable block this client allocated (`alloc`): which node holds it, and where."""

    node: int
    key: bytes
    location: Location


def rendezvous_order(nodes: Sequence[str], key: bytes) -> list[int]:
    """Indices into `nodes` ("host:port" each) in rendezvous order for `key`, highest score first:
    what every client computes, whatever order it lists the nodes in."""
    return sorted(range(len(nodes)), key=lambda i: (xxhash.xxh3_64_intdigest(str(nodes[i]).encode() + key),
                                                    str(nodes[i])), reverse=True)


class PoolClient:
    """Keyed access to the pool nodes of one tenant. Thread-safe.

    Args:
        nodes: "host:port" of each node; the order does not matter.
        tenant, secret: credentials (an open node takes tenant "default" with an empty secret).
        timeout_s: the longest any one call to a node may take.
        reconnect_s: how long a failed node is skipped before it is tried again.
        lease_s: read lease asked for on each hit (a slot being read is not reused before).
        put_lease_s: how long a started put may take before the node reclaims its slot.
        transport: the data plane asked for (see the module docstring).
        verbs: the verbs provider under RDMA (`kvtier.pool.verbs.load_verbs`): pyverbs, or a test
            double's module name.
    Raises:
        ConfigError: no nodes, an address that is not HOST:PORT, or `rdma` asked for on a host
            that cannot open an RDMA device.
    """

    def __init__(self, nodes: Sequence[str], *, tenant: str = "default", secret: bytes = b"",
                 timeout_s: float = 2.0, reconnect_s: float = 1.0, lease_s: float = 5.0,
                 put_lease_s: float = 30.0, transport: TransportKind = TransportKind.TCP,
                 verbs: str = "pyverbs") -> None:
        if not nodes:
            raise ConfigError("pool client: nodes: at least one HOST:PORT is needed")
        names = [str(n) for n in nodes]
        if len(set(names)) != len(names):
            raise ConfigError(f"pool client: nodes: duplicate address in {names}")
        self.tenant, self.timeout_s = tenant, timeout_s
        self.lease_s, self.put_lease_s = lease_s, put_lease_s
        self.links = [NodeLink(n, parse_address(n, f"pool node {n}"), tenant, secret, timeout_s=timeout_s,
                               reconnect_s=reconnect_s) for n in names]
        self.verbs = verbs
        local, self._local_reason = choose_transport(transport, verbs=verbs)
        self.transports: list[Transport] = [TCPTransport(link) for link in self.links]
        self._reasons = [self._local_reason] * len(names)
        # auto with a usable device here: each node's data plane waits for the node to say what it serves
        self._undecided = set(range(len(names))) if transport is TransportKind.AUTO and local is TransportKind.RDMA \
            else set()
        if transport is TransportKind.RDMA:
            self.transports = [_rdma_transport(link, verbs) for link in self.links]
        self._host_memory: list[tuple[int, int, object]] = []  # see register_memory
        self._names = tuple(names)  # placement's node names, as `rendezvous_order` takes them
        self.nodes = [NodeCalls(link, functools.partial(self._data_plane, i), self._count_all, lease_s, put_lease_s)
                      for i, link in enumerate(self.links)]
        self._lock = threading.Lock()
        self._counters: Counter = Counter()
        self._fanout = ThreadPoolExecutor(len(names), thread_name_prefix="kvtier-pool") if len(names) > 1 else None

    # ---- keyed blocks -----------------------------------------------------------------------

    def placement(self, key: bytes) -> list[int]:
        """Node indices in rendezvous order for `key` (highest score first)."""
        return rendezvous_order(self._names, key)

    def home(self, key: bytes) -> int:
        """The node a key is stored on and looked up at now: the first in `placement` not marked down."""
        if len(self.links) == 1:
            return 0
        order = self.placement(key)
        return next((i for i in order if not self.links[i].down), order[0])

    def put(self, key: bytes, data: Any) -> bool:
        return self.batch_put([key], [data])[0]

    def get(self, key: bytes, into: Any) -> bool:
        return self.batch_get([key], [into])[0]

    def batch_put(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[bool]:
        """Stores each block under its key. True: stored now or already there. False: not stored
        (the node is full of leased blocks, the quota is spent, the node is unreachable...)."""
        return [status in STORED for status in self.batch_put_status(keys, blocks)]

    def batch_put_status(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[GrantStatus | None]:
        """As `batch_put`, with each block's outcome: GRANTED (stored now), EXISTS (stored already),
        BUSY (another client is writing that key now), the node's refusal (FULL, QUOTA, LIMIT,
        TOO_LARGE), or None (the node did not answer, or the write did not go through).

        A block may be given as a tuple of buffers, stored as their concatenation (a header and
        the block's bytes, with no copy to join them)."""
        views = [tuple(byte_view(p, writable=False, what=f"block {i}") for p in b) if isinstance(b, tuple)
                 else byte_view(b, writable=False, what=f"block {i}") for i, b in enumerate(blocks)]
        out = self._per_node(keys, lambda i, ks, js: self.nodes[i].put(ks, [views[j] for j in js]))
        return [status if status is not False else None for status in out]

    def batch_get(self, keys: Sequence[bytes], intos: Sequence[Any]) -> list[bool]:
        """Copies each stored block into its buffer, which must be the block's exact size.
        True: the bytes are there and verified. False: a miss (buffer content undefined).

        Raises:
            ValueError: a buffer is not the stored block's size.
        """
        views = [byte_view(b, writable=True, what=f"buffer {i}") for i, b in enumerate(intos)]
        choose = lambda j, length: [views[j]] if length == len(views[j]) else None
        return self._per_node(keys, lambda i, ks, js: self.nodes[i].get(ks, lambda k, n: choose(js[k], n), strict=True))

    def get_streamed(self, key: bytes, parts: Callable[[int], Sequence[Any] | None],
                     landed: Callable[[int], None] | None = None,
                     checks_parts: Callable[[int], bool] | None = None) -> bool:
        """`get_streamed_many` of one key (the callbacks without the key's position)."""
        return self.get_streamed_many(
            [key], lambda j, length: parts(length), None if landed is None else lambda j, part: landed(part),
            None if checks_parts is None else lambda j, length: checks_parts(length))[0]

    def get_streamed_many(self, keys: Sequence[bytes], parts: Callable[[int, int], Sequence[Any] | None],
                          landed: Callable[[int, int], None] | None = None,
                          checks_parts: Callable[[int, int], bool] | None = None,
                          summed: Callable[[int, int], Any] | None = None) -> list[bool]:
        """Reads blocks into consecutive buffers, `parts(j, length)` for key j stored as `length`
        bytes (None: not a length the caller reads, a miss counted `wrong_size`), calling
        `landed(j, i)` as soon as part i of key j is in, in order: over TCP the parts of one
        inline reply as they come off the socket (one GET per node for the batch), else
        one-sided reads of the parts' ranges under read leases. Per key True: every part is in
        and the whole block matched its checksum. False: a miss, a node down, a length the caller
        does not read, or a checksum mismatch (counted as `get` counts them); parts already
        reported landed are then not to be used.

        `parts` and `landed` run on the receiving thread; they must be quick and not raise.
        `checks_parts(j, length)`: True where the caller checks every part itself (a framed
        block chunk by chunk against its header as it lands, or the whole block against
        checksums of its own once read), so the whole block's checksum is not computed again
        here (a pass over its bytes saved). `summed(j, i)`: a `kvtier.tiers.base.LayerSums` whose
        layer checksums of part i of key j are computed as its bytes come off the socket (an
        inline TCP reply; its `done` says whether they were), or None.
        """
        def choose(js: Sequence[int], k: int, length: int) -> list[memoryview] | None:
            got = parts(js[k], length)
            views = None if got is None else [byte_view(b, writable=True, what=f"part {i}") for i, b in enumerate(got)]
            return views if views is not None and sum(map(len, views)) == length else None

        return self._per_node(keys, lambda i, ks, js: self.nodes[i].get(
            ks, lambda k, n: choose(js, k, n), strict=False,
            landed=None if landed is None else lambda k, part: landed(js[k], part),
            checks_parts=None if checks_parts is None else lambda k, n: checks_parts(js[k], n),
            summed=None if summed is None else lambda k, part: summed(js[k], part)))

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is stored (a node that is down answers False)."""
        return self._per_node(keys, lambda i, ks, js: self.links[i].call(MsgType.CONTAINS, {"keys": ks})["found"])

    def delete(self, keys: Sequence[bytes]) -> int:
        """Drops keys; returns how many were dropped (blocks being read are kept)."""
        counts = self._per_node(keys, lambda i, ks, js: [self.links[i].call(MsgType.DELETE, {"keys": ks})["deleted"]]
                                + [0] * (len(ks) - 1))
        return sum(counts)

    # ---- mutable slots (the Tier adapter) ---------------------------------------------------

    def alloc(self, key: bytes, length: int) -> Slot:
        """A mutable block of `length` bytes under `key` on the key's home node.

        Raises:
            TransferError: no room (the reason is in the message) or the node is unreachable.
        """
        node = self.home(key)
        grant = self.links[node].call(MsgType.ALLOC, {"keys": [key], "lengths": [length]})["grants"][0]
        status = GrantStatus(grant[0])
        if status is not GrantStatus.GRANTED:
            self._count(f"alloc_{status.name.lower()}")
            raise TransferError(f"pool node {self.links[node].name}: cannot allocate {length} bytes: {status.name}")
        return Slot(node, key, Location(grant[1], grant[2], length, grant[3]))

    def read_at(self, slot: Slot, offset: int, dst: Any) -> bool:
        """Reads `len(dst)` bytes at `offset` of a slot. False: the node dropped the slot.

        Raises:
            TransferError: the node is unreachable or refused the access.
        """
        view = byte_view(dst, writable=True, what="read buffer")
        return self._data_plane(slot.node).read(slot.location.sub(offset, len(view)), view)

    def write_at(self, slot: Slot, offset: int, src: Any) -> bool:
        """Writes `src` at `offset` of a slot. False: the node dropped the slot. Raises as `read_at`."""
        view = byte_view(src, writable=False, what="write source")
        return self._data_plane(slot.node).write(slot.location.sub(offset, len(view)), view)

    def alloc_many(self, keys: Sequence[bytes], length: int) -> list[Slot | TransferError]:
        """`alloc` of many keys, one ALLOC per home node, nodes in parallel; per key the slot or
        the error `alloc` would raise."""
        def on(node: int, ks: list[bytes]) -> list[Slot | TransferError]:
            grants = [g for s in range(0, len(ks), MAX_BATCH) for g in self.links[node].call(
                MsgType.ALLOC, {"keys": ks[s: s + MAX_BATCH], "lengths": [length] * len(ks[s: s + MAX_BATCH])})["grants"]]
            out: list[Slot | TransferError] = []
            for key, grant in zip(ks, grants):
                status = grant_status(grant[0])
                if status is GrantStatus.GRANTED:
                    out.append(Slot(node, key, Location(grant[1], grant[2], length, grant[3])))
                else:
                    self._count(f"alloc_{status.name.lower() if status else grant[0]}")
                    out.append(TransferError(f"pool node {self.links[node].name}: cannot allocate {length} "
                                             f"bytes: {status.name if status else grant[0]}"))
            return out

        return self._by_node([self.home(k) for k in keys], lambda node, js: on(node, [keys[j] for j in js]))

    def access_many(self, slots: Sequence[Slot], offset: int, buffers: Sequence[Any], *,
                    write: bool) -> list[bool | TransferError]:
        """`write_at` (`write`) or `read_at` of many slots at `offset`, one batch of one-sided
        accesses per node (pipelined on one connection over TCP, one chain of work requests over
        RDMA), nodes in parallel. Per slot: True, False (the node dropped the slot), or the
        `TransferError` its node's batch raised (`NodeUnavailable`: the node did not answer)."""
        views = [byte_view(b, writable=not write, what=f"buffer {i}") for i, b in enumerate(buffers)]

        def on(node: int, js: list[int]) -> list[bool]:
            transport = self._data_plane(node)
            ios = [RemoteIO(slots[j].location.sub(offset, len(views[j])), views[j]) for j in js]
            return transport.write_many(ios) if write else transport.read_many(ios)

        return self._by_node([s.node for s in slots], on)

    def free(self, slots: Sequence[Slot]) -> None:
        """Drops slots, best effort: a node that is down drops them by recency later."""
        by_node: dict[int, list[bytes]] = {}
        for s in slots:
            by_node.setdefault(s.node, []).append(s.key)
        for node, keys in by_node.items():
            for start in range(0, len(keys), MAX_BATCH):
                try:
                    self.links[node].call(MsgType.DELETE, {"keys": keys[start: start + MAX_BATCH]})
                except NodeUnavailable:
                    break

    # ---- shared-tier KV events (`kvtier.pool.client.events`) ---------------------------------

    def announce(self, keys: Sequence[bytes], hashes: Sequence[int | bytes], *, block_size: int,
                 parents: Sequence[int | bytes | None] | None = None,
                 tokens: Sequence[Sequence[int]] | None = None) -> dict[str, int]:
        """Tells each key's home node the engine's block hash of the block stored under it (with its
        parent's hash and its `block_size` tokens where known), so that the node publishes the
        tenant's `BlockStored`/`BlockRemoved` events for it. Keys not stored (or not yet) are ignored.

        Returns:
            {"announced", "ignored", "failed"}: blocks counted by the nodes, and keys whose node
            could not be reached or predates events (`events.NotServed`, logged).
        """
        return announce_by_home(self.links, self.home, keys, hashes, block_size,
                                parents if parents is not None else [None] * len(keys),
                                tokens if tokens is not None else [()] * len(keys))

    def retain(self, keys: Sequence[bytes], ttl_s: float) -> dict[str, int]:
        """Asks each key's home node to keep the block for `ttl_s` seconds (a soft lease: its node
        caps the time and the tenant's retained bytes, and evicts retained blocks only when nothing
        else of the tenant's is left). Deadlines only grow.

        Returns:
            {"retained", "over_budget", "missing", "not_served", "failed"}: blocks leased, refused
            for the tenant's budget, not held; keys whose node predates RETAIN or was not reached
            (see `kvtier.pool.client.hints`). Raises `AuthFailed` only.
        """
        return self._hint(MsgType.RETAIN, keys, {"ttl_s": ttl_s})

    def release_hint(self, keys: Sequence[bytes]) -> dict[str, int]:
        """Tells each key's home node that the block's session closed: its lease ends and it
        becomes the tenant's next victim there. Returns {"released", "not_served", "failed"}."""
        return self._hint(MsgType.RELEASE_HINT, keys, {})

    def _hint(self, msg: MsgType, keys: Sequence[bytes], fields: dict) -> dict[str, int]:
        out = hint_by_home(self.links, self.home, msg, keys, fields)
        self._count_all({f"{msg.name.lower()}_{name}": n for name, n in out.items()
                         if name in ("not_served", "failed") and n})
        return out

    def subscribe(self, node: int = 0, from_seq: int | None = None) -> EventStream:
        """A stream of this tenant's shared-tier KV events on node `node` (an `events.EventStream`:
        iterate it, close it to unsubscribe); with `from_seq`, the node's kept batches from that
        seq come first. Raises as `EventStream`."""
        return EventStream(self.links[node], from_seq)

    # ---- facts and lifecycle ----------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        """Each node's stats (as its tenant sees them), or `{"node": address, "error": ...}`."""
        out = []
        for i, link in enumerate(self.links):
            try:
                facts = link.call(MsgType.STATS, {})["stats"]
                self._data_plane(i)  # the node has said which data plane it serves
                out.append({"address": link.name, **facts})
            except AuthFailed:
                raise
            except NodeUnavailable as e:
                out.append({"address": link.name, "error": str(e)})
        return out

    def register_memory(self, address: int, length: int, owner: object) -> None:
        """Declares host memory that buffers passed to `read_at`/`write_at` often lie in (the
        runtime's DRAM slab), for every node's data plane, present and chosen later: RDMA
        registers it and moves those buffers without a staging copy (see `RDMATransport`); TCP
        ignores it. `owner` keeps the memory alive while the client may use it."""
        with self._lock:
            self._host_memory.append((address, length, owner))
            transports = list(self.transports)
        for transport in transports:
            transport.register_memory(address, length, owner)

    def transport_facts(self) -> list[tuple[str, str]]:
        """Per node, the data plane in use and why, e.g. `("tcp", "auto: node serves tcp only")`;
        `("undecided", ...)` for an `auto` node not reached yet."""
        with self._lock:
            return [("undecided", "auto: node not reached yet") if i in self._undecided else
                    (self.transports[i].name, self._reasons[i]) for i in range(len(self.links))]

    @property
    def counters(self) -> dict[str, int]:
        """hits, misses, puts, put_exists, put_rejected_*, node_errors, stale, checksum_errors, lease_limit,
        put_frames (PUT or MULTI_PUT frames sent), node_calls (one per node and batched call: a GET, CONTAINS, a put's pipelined frames or its
        PUT_BEGIN/writes/PUT_COMMIT, a batch of one-sided accesses)..."""
        with self._lock:
            return dict(self._counters)

    def close(self) -> None:
        """Releases pending leases (best effort) and closes every connection. Idempotent."""
        for i, link in enumerate(self.links):
            leases = self.nodes[i].take_releases()
            if leases and not link.down:
                try:
                    link.call(MsgType.RELEASE, {"leases": leases})
                except NodeUnavailable:
                    pass
            link.close()
        for t in self.transports:
            t.close()
        if self._fanout is not None:
            self._fanout.shutdown(wait=True)

    def __enter__(self) -> PoolClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- per node -----------------------------------------------------------------------------

    def _per_node(self, keys: Sequence[bytes], fn: Callable[[int, list[bytes], list[int]], list]) -> list:
        """Runs `fn(node, keys, positions)` once per node and batch (nodes in parallel); a node
        that fails gives a falsy result for its keys."""
        if len(self.links) == 1 and len(keys) <= MAX_BATCH:  # the whole call is one batch to one node
            return self._guarded(0, fn, list(keys), range(len(keys)))
        groups: dict[int, list[int]] = {}
        for j, key in enumerate(keys):
            groups.setdefault(self.home(key), []).append(j)
        jobs = [(node, js[s: s + MAX_BATCH]) for node, js in groups.items() for s in range(0, len(js), MAX_BATCH)]
        return self._fan_out(jobs, lambda job: self._guarded(job[0], fn, [keys[j] for j in job[1]], job[1]),
                             len(keys), False)

    def _by_node(self, nodes: Sequence[int], fn: Callable[[int, list[int]], list]) -> list:
        """Runs `fn(node, positions)` once per node of `nodes[j]` (nodes in parallel); a node whose
        call raises a `TransferError` gives that error for each of its positions."""
        groups: dict[int, list[int]] = {}
        for j, node in enumerate(nodes):
            groups.setdefault(node, []).append(j)

        def run(job: tuple[int, list[int]]) -> list:
            self._count("node_calls")
            try:
                return fn(*job)
            except AuthFailed:
                raise
            except TransferError as e:
                if isinstance(e, NodeUnavailable):
                    self._count("node_errors")
                return [e] * len(job[1])

        return self._fan_out(list(groups.items()), run, len(nodes), None)

    def _fan_out(self, jobs: list[tuple[int, list[int]]], run: Callable, n: int, missing) -> list:
        """Runs every (node, positions) job (in parallel where there are several) and puts each
        job's results back at its positions of a list of `n` (`missing` where no job put one)."""
        results = list(self._fanout.map(run, jobs)) if self._fanout and len(jobs) > 1 else [run(j) for j in jobs]
        out: list = [missing] * n
        for (_, js), res in zip(jobs, results):
            for j, r in zip(js, res):
                out[j] = r
        return out

    def _guarded(self, node: int, fn, keys: list[bytes], js: list[int]) -> list:
        self._count("node_calls")
        try:
            return fn(node, keys, js)
        except AuthFailed:
            raise
        except NodeUnavailable as e:
            self._count("node_errors")
            log.debug("%s", e)
            return [False] * len(keys)

    def _data_plane(self, node: int) -> Transport:
        """The node's transport; under `auto`, chosen on first use from what the node serves.

        Raises:
            NodeUnavailable: an undecided node cannot be reached (it stays undecided).
        """
        if node in self._undecided:
            link = self.links[node]
            if link.transport is None:
                with link.connection():
                    pass  # the node's welcome names its data plane
            with self._lock:
                if node in self._undecided:
                    self._undecided.discard(node)
                    if link.transport == TransportKind.RDMA.value:
                        self.transports[node] = _rdma_transport(link, self.verbs)
                        for memory in self._host_memory:
                            self.transports[node].register_memory(*memory)
                        self._reasons[node] = f"{self._local_reason}; node serves rdma"
                    else:
                        self._reasons[node] = f"auto: node serves {link.transport} only"
        return self.transports[node]

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _count_all(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counters[name] += n


def _rdma_transport(link: NodeLink, verbs: str) -> Transport:
    from kvtier.pool.client.rdma import RDMATransport  # verbs only where RDMA is used

    return RDMATransport(link, verbs=verbs)
