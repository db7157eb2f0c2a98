"""`PoolClient`: keyed blocks on one or more pool nodes, shared by every client of a tenant.

A key lives on one node, chosen by rendezvous hashing over the configured node addresses (every
client with the same node list agrees, and losing a node moves only that node's keys): the key's
home is the highest-ranked node that is not marked down. Calls are batched per node, nodes run in
parallel, and every call has a timeout.

put:  PUT_BEGIN (a slot under a write lease) -> one-sided WRITE of the bytes -> PUT_COMMIT (visible).
      Over TCP one MULTI_PUT frame per node carries all three for the batch, bytes included (one
      PUT frame per block to a node older than MULTI_PUT): one round trip, as a raw socket
      (a block the node holds already is sent anyway, then dropped and counted in the node's
      `duplicate_put_bytes`; `PoolNode._put` says why that beats asking first).
get:  GET (location + read lease + checksum) -> one-sided READ -> xxh3-64 check (seeded with the
      key: `block_checksum`); the lease is released with the next GET to that node (or expires),
      which saves a round trip per get. A node that answers LIMIT (this client holds as many
      leases as it may) leased nothing: its keys are misses.
      Over TCP the GET asks for the hits' bytes inline instead: one round trip, as a raw socket.

Faults are misses, never errors and never wrong bytes: a node that is down, slow or dies mid-call
yields False for its keys; a block whose bytes do not match their checksum is a miss. A wrong
tenant secret is not a fault but a configuration error, and raises `AuthFailed`.

Data plane per node (`transport`): `tcp`; `rdma` (this host must open an RDMA device, and a node
that does not serve RDMA refuses it loudly: its accesses raise `TransferError`); or `auto`, which
picks RDMA for a node once that node's welcome says it serves RDMA and this host can open a device,
TCP otherwise. The choice and its reason are kept per node (`transport_facts`), never swapped later.
"""

from __future__ import annotations

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
from kvtier.pool.buffers import block_checksum, byte_view
from kvtier.pool.client.connection import AuthFailed, NodeConnection, NodeLink, NodeUnavailable, RemoteError, Request
from kvtier.pool.detect import TransportKind, choose_transport
from kvtier.pool.protocol import MAX_BATCH, MAX_INLINE_BYTES, ErrorCode, GrantStatus, MsgType
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
        self._releases: list[list[int]] = [[] for _ in names]
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
        return [status in _STORED for status in self.batch_put_status(keys, blocks)]

    def batch_put_status(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> list[GrantStatus | None]:
        """As `batch_put`, with each block's outcome: GRANTED (stored now), EXISTS (stored already),
        BUSY (another client is writing that key now), the node's refusal (FULL, QUOTA, LIMIT,
        TOO_LARGE), or None (the node did not answer, or the write did not go through).

        A block may be given as a tuple of buffers, stored as their concatenation (a header and
        the block's bytes, with no copy to join them)."""
        views = [tuple(byte_view(p, writable=False, what=f"block {i}") for p in b) if isinstance(b, tuple)
                 else byte_view(b, writable=False, what=f"block {i}") for i, b in enumerate(blocks)]
        out = self._per_node(keys, lambda i, ks, js: self._put_on(i, ks, [views[j] for j in js]))
        return [status if status is not False else None for status in out]

    def batch_get(self, keys: Sequence[bytes], intos: Sequence[Any]) -> list[bool]:
        """Copies each stored block into its buffer, which must be the block's exact size.
        True: the bytes are there and verified. False: a miss (buffer content undefined).

        Raises:
            ValueError: a buffer is not the stored block's size.
        """
        views = [byte_view(b, writable=True, what=f"buffer {i}") for i, b in enumerate(intos)]
        choose = lambda j, length: [views[j]] if length == len(views[j]) else None
        return self._per_node(keys, lambda i, ks, js: self._get_on(i, ks, lambda k, n: choose(js[k], n), strict=True))

    def batch_get_parts(self, keys: Sequence[bytes], parts: Callable[[int, int], Sequence[Any] | None]) -> list[bool]:
        """As `batch_get`, into consecutive buffers chosen by the stored length: `get_streamed_many`
        with nothing reported as it lands."""
        return self.get_streamed_many(keys, parts)

    def get_streamed(self, key: bytes, parts: Callable[[int], Sequence[Any] | None],
                     landed: Callable[[int], None] | None = None,
                     checks_parts: Callable[[int], bool] | None = None) -> bool:
        """`get_streamed_many` of one key (the callbacks without the key's position)."""
        return self.get_streamed_many(
            [key], lambda j, length: parts(length), None if landed is None else lambda j, part: landed(part),
            None if checks_parts is None else lambda j, length: checks_parts(length))[0]

    def get_streamed_many(self, keys: Sequence[bytes], parts: Callable[[int, int], Sequence[Any] | None],
                          landed: Callable[[int, int], None] | None = None,
                          checks_parts: Callable[[int, int], bool] | None = None) -> list[bool]:
        """Reads blocks into consecutive buffers, `parts(j, length)` for key j stored as `length`
        bytes (None: not a length the caller reads, a miss counted `wrong_size`), calling
        `landed(j, i)` as soon as part i of key j is in, in order: over TCP the parts of one
        inline reply as they come off the socket (one GET per node for the batch), else
        one-sided reads of the parts' ranges under read leases. Per key True: every part is in
        and the whole block matched its checksum. False: a miss, a node down, a length the caller
        does not read, or a checksum mismatch (counted as `get` counts them); parts already
        reported landed are then not to be used.

        `parts` and `landed` run on the receiving thread; they must be quick and not raise.
        `checks_parts(j, length)`: True where the caller checks every part itself as it lands (a
        framed block, chunk by chunk against its header), so the whole block's checksum is not
        computed again here (a pass over its bytes saved).
        """
        def choose(js: Sequence[int], k: int, length: int) -> list[memoryview] | None:
            got = parts(js[k], length)
            views = None if got is None else [byte_view(b, writable=True, what=f"part {i}") for i, b in enumerate(got)]
            return views if views is not None and sum(map(len, views)) == length else None

        return self._per_node(keys, lambda i, ks, js: self._get_on(
            i, ks, lambda k, n: choose(js, k, n), strict=False,
            landed=None if landed is None else lambda k, part: landed(js[k], part),
            checks_parts=None if checks_parts is None else lambda k, n: checks_parts(js[k], n)))

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
                status = _status(grant[0])
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
            leases = self._take_releases(i)
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

    def _put_on(self, node: int, keys: list[bytes], views: list[memoryview]) -> list[GrantStatus | None]:
        if self._data_plane(node).inline:
            return self._put_inline(node, keys, views)
        with self.links[node].connection() as conn:  # the write leases are this connection's: see _get_on
            return self._put_leased(node, conn, keys, views)

    def _put_leased(self, node: int, conn: NodeConnection, keys: list[bytes],
                    views: list[memoryview]) -> list[GrantStatus | None]:
        """PUT_BEGIN, one-sided writes and PUT_COMMIT (or PUT_ABORT) on `conn`, which holds the leases."""
        sums: list[int] = []
        grants = conn.request(Request(MsgType.PUT_BEGIN, {"keys": keys, "lengths": [_length(v) for v in views],
                                                          "lease_s": self.put_lease_s}),
                              overlap=lambda: sums.extend(map(_checksum, keys, views)))["grants"]
        out: list[GrantStatus | None] = [_status(g[0]) for g in grants]
        todo = [j for j, g in enumerate(grants) if g[0] == GrantStatus.GRANTED]
        counts = {"put_exists": out.count(GrantStatus.EXISTS)}
        for g in grants:
            if g[0] not in (GrantStatus.GRANTED, GrantStatus.EXISTS):
                counts[_rejection(g[0])] = counts.get(_rejection(g[0]), 0) + 1
        self._count_all(counts)
        for j in todo:
            out[j] = None  # until written and committed
        if not todo:
            return out
        transport = self.transports[node]
        ios, owner = [], []  # one io per buffer; owner: the block each belongs to
        for j in todo:
            location, at = Location(grants[j][1], grants[j][2], _length(views[j]), grants[j][3]), 0
            parts = views[j] if isinstance(views[j], tuple) else (views[j],)
            if transport.inline and len(parts) > 1:
                raise ValueError("a block of several buffers needs the put's own commit, not WRITE_COMMIT")
            for part in parts:
                ios.append(RemoteIO(location.sub(at, len(part)), part, sums[j] if transport.inline else None))
                owner.append(j)
                at += len(part)
        written = transport.write_many(ios)
        bad = {j for j, ok in zip(owner, written) if not ok}
        done = [j for j in todo if j not in bad]
        lost = [j for j in todo if j in bad]
        if lost:  # a write or commit that did not go through: free the slot now, not at lease expiry
            conn.call(MsgType.PUT_ABORT, {"keys": [keys[j] for j in lost], "gens": [grants[j][3] for j in lost]})
        if done and not transport.inline:
            ok = conn.call(MsgType.PUT_COMMIT, {"keys": [keys[j] for j in done], "gens": [grants[j][3] for j in done],
                                                "checksums": [sums[j] for j in done]})["ok"]
            done = [j for j, committed in zip(done, ok) if committed]
        for j in done:
            out[j] = GrantStatus.GRANTED
        self._count("puts", len(done))
        return out

    def _put_inline(self, node: int, keys: list[bytes], views: list[memoryview]) -> list[GrantStatus | None]:
        """The batch's blocks with their bytes in the request: one round trip instead of two. The
        price: a block the node holds already is sent anyway (the node drains it, answers EXISTS
        and counts the bytes in its `duplicate_put_bytes`; see `PoolNode._put`). One MULTI_PUT
        frame for the batch (more only past the node's frame limit), or, to a node older than
        MULTI_PUT, one PUT frame per block, pipelined."""
        with self.links[node].connection() as conn:  # its handshake tells the link whether MULTI_PUT is served
            put = self._put_multi if self.links[node].multi_put else self._put_each
            statuses, stored = put(node, conn, keys, views)
        out: list[GrantStatus | None] = [
            GrantStatus.GRANTED if ok else None if s == GrantStatus.GRANTED else _status(s)
            for s, ok in zip(statuses, stored)]
        counts = {"put_exists": statuses.count(GrantStatus.EXISTS), "puts": out.count(GrantStatus.GRANTED)}
        for s in statuses:
            if s not in (GrantStatus.GRANTED, GrantStatus.EXISTS):
                counts[_rejection(s)] = counts.get(_rejection(s), 0) + 1
        self._count_all(counts)
        return out

    def _put_multi(self, node: int, conn: NodeConnection, keys: list[bytes], views: list) -> tuple[list[int], list[bool]]:
        """MULTI_PUT frames of the batch, each at most the node's frame limit in bytes (a block
        above it alone is TOO_LARGE); returns (status, stored) per block.

        Raises:
            NodeUnavailable: the node did not answer, refused a frame, or answered it wrongly.
        """
        statuses, stored = [int(GrantStatus.TOO_LARGE)] * len(keys), [False] * len(keys)
        lengths = [_length(v) for v in views]
        frames = _frames_within(lengths, conn.max_payload)
        requests = [Request(MsgType.MULTI_PUT, {
            "keys": [keys[j] for j in js], "lengths": [lengths[j] for j in js],
            "checksums": [_checksum(keys[j], views[j]) for j in js], "lease_s": self.put_lease_s},
            payload=tuple(p for j in js for p in (views[j] if isinstance(views[j], tuple) else (views[j],))))
            for js in frames]
        try:
            replies = conn.call_many(requests)
        except NodeUnavailable as e:
            if e.code is ErrorCode.MALFORMED:
                self.links[node].multi_put = None  # the node may have been replaced by an older one: ask again
            raise
        self._count("put_frames", len(requests))
        for js, reply in zip(frames, replies):
            results = reply.get("results") if isinstance(reply, dict) else None
            if results is None or len(results) != len(js):
                raise NodeUnavailable(f"pool node {self.links[node].name}: multi-put of {len(js)} blocks: "
                                      f"{reply if results is None else f'{len(results)} results'}")
            for j, (status, ok) in zip(js, results):
                statuses[j], stored[j] = status, ok
        return statuses, stored

    def _put_each(self, node: int, conn: NodeConnection, keys: list[bytes], views: list) -> tuple[list[int], list[bool]]:
        """A PUT frame per block, pipelined (a node older than MULTI_PUT); returns as `_put_multi`."""
        sent = [j for j, v in enumerate(views) if _length(v) <= conn.max_payload]
        replies = conn.call_many([Request(MsgType.PUT, {"key": keys[j], "lease_s": self.put_lease_s,
                                                        "checksum": _checksum(keys[j], views[j])},
                                          payload=views[j]) for j in sent])
        self._count("put_frames", len(sent))
        statuses, stored = [int(GrantStatus.TOO_LARGE)] * len(keys), [False] * len(keys)
        for j, reply in zip(sent, replies):
            if isinstance(reply, RemoteError):
                raise NodeUnavailable(f"pool node {self.links[node].name}: put of {keys[j].hex()}: {reply}")
            statuses[j], stored[j] = reply["status"], reply["stored"]
        return statuses, stored

    def _get_on(self, node: int, keys: list[bytes], choose: Callable[[int, int], list[memoryview] | None],
                strict: bool, landed: Callable[[int, int], None] | None = None,
                checks_parts: Callable[[int, int], bool] | None = None) -> list[bool]:
        """One GET of `keys` on `node`, each hit's bytes into `choose(j, stored length)` (None: a
        length the caller does not read; `strict`: a ValueError once the reply is in, else a
        miss counted `wrong_size`), `landed(j, i)` as part i of key j is in (see
        `get_streamed_many`)."""
        transport = self._data_plane(node)
        chosen: list[list[memoryview] | None] = [None] * len(keys)
        owners: list[tuple[int, int]] = []  # per buffer of an inline reply: (key, part), part -1 for scratch

        def inline_buffers(header: dict) -> list[memoryview]:
            """Where an inline reply's bytes go, hit by hit (a length not read lands in scratch)."""
            out: list[memoryview] = []
            for j, h in enumerate(header["hits"][: len(keys)]):
                if h[0] and h[7]:
                    chosen[j] = choose(j, h[3])
                    if chosen[j] is None:
                        out.append(memoryview(bytearray(h[3])))
                        owners.append((j, -1))
                    else:
                        out.extend(chosen[j])
                        owners.extend((j, i) for i in range(len(chosen[j])))
            return out

        def on_inline_part(b: int) -> None:
            j, part = owners[b]
            if part >= 0:
                landed(j, part)

        request = Request(MsgType.GET, {"keys": keys, "lease_s": self.lease_s, "release": self._take_releases(node),
                                        "inline": transport.inline}, into=inline_buffers,
                          max_reply_payload=MAX_INLINE_BYTES, landed=None if landed is None else on_inline_part)
        # One loan for the GET and the reads of its leased hits: the node ends a connection's
        # leases when it closes, and a connection handed back may be closed at once (pool full).
        with self.links[node].connection() as conn:
            try:
                hits = conn.request(request)["hits"]
            except RemoteError as e:
                if e.code is not ErrorCode.LIMIT:
                    raise
                self._count_all({"misses": len(keys), "lease_limit": 1})  # the node leased nothing
                return [False] * len(keys)
            found, read = self._read_leased(node, keys, hits, choose, chosen, strict, landed)
        out = [False] * len(keys)
        stale = corrupt = wrong = 0
        for j in found:
            if chosen[j] is None:
                wrong += 1
                continue
            moved = read.get(j, True)  # an inline hit came with the reply
            checked = checks_parts is not None and checks_parts(j, hits[j][3])
            out[j] = moved and (checked or _checksum(keys[j], _one_or_tuple(chosen[j])) == hits[j][5])
            stale += not moved
            corrupt += moved and not out[j]
        self._count_all({"hits": sum(out), "stale": stale, "checksum_errors": corrupt, "wrong_size": wrong})
        return out

    def _read_leased(self, node: int, keys: list[bytes], hits: list,
                     choose: Callable[[int, int], list[memoryview] | None], chosen: list[list[memoryview] | None],
                     strict: bool, landed: Callable[[int, int], None] | None) -> tuple[list[int], dict[int, bool]]:
        """Checks a GET's answer, queues its leases for release, chooses the leased hits' buffers
        (into `chosen`) and reads them; returns the positions found and, per leased one read,
        whether its bytes moved.

        Raises:
            NodeUnavailable: an answer of the wrong length.
            ValueError: `strict`, and a hit of a length the caller does not read.
        """
        if len(hits) != len(keys):
            raise NodeUnavailable(f"pool node {self.links[node].name}: {len(hits)} answers to {len(keys)} keys")
        found = [j for j, h in enumerate(hits) if h[0]]
        leased = [j for j in found if not hits[j][7]]
        if leased or len(found) < len(keys):  # before anything below can raise
            with self._lock:
                self._releases[node] += [hits[j][6] for j in leased]
                self._counters["misses"] += len(keys) - len(found)
        for j in leased:
            chosen[j] = choose(j, hits[j][3])
        for j in found if strict else ():
            if chosen[j] is None:
                raise ValueError(f"pool block {keys[j].hex()}: stored {hits[j][3]} bytes, not the buffer's size")
        ios, owner = [], []  # owner: per io, (key, part)
        for j in leased:
            location, at = Location(*hits[j][1:5]), 0
            for i, view in enumerate(chosen[j] or ()):
                ios.append(RemoteIO(location.sub(at, len(view)), view))
                owner.append((j, i))
                at += len(view)
        if not ios:
            return found, {}
        moved: dict[int, bool] = {}
        on_io = None if landed is None else lambda b: landed(*owner[b])
        for (j, _), ok in zip(owner, self.transports[node].read_many(ios, on_io)):
            moved[j] = moved.get(j, True) and ok
        return found, moved

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

    def _take_releases(self, node: int) -> list[int]:
        if not self._releases[node]:  # a read without the lock: a lease added meanwhile goes next time
            return []
        with self._lock:
            leases, self._releases[node] = self._releases[node][:MAX_BATCH], self._releases[node][MAX_BATCH:]
        return leases

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _count_all(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, n in counts.items():
                self._counters[name] += n


_STORED = (GrantStatus.GRANTED, GrantStatus.EXISTS)


def _frames_within(lengths: Sequence[int], max_bytes: int) -> list[list[int]]:
    """Positions of blocks of `lengths` cut into consecutive frames of at most `max_bytes` each (a
    block longer than that is in none: the node could not take it)."""
    frames: list[list[int]] = []
    room = 0
    for j, n in enumerate(lengths):
        if n > max_bytes:
            continue
        if not frames or n > room:
            frames.append([])
            room = max_bytes
        frames[-1].append(j)
        room -= n
    return frames


def _length(block: memoryview | tuple[memoryview, ...]) -> int:
    return sum(map(len, block)) if isinstance(block, tuple) else len(block)


def _one_or_tuple(views: list[memoryview]) -> memoryview | tuple[memoryview, ...]:
    return views[0] if len(views) == 1 else tuple(views)


def _checksum(key: bytes, block: memoryview | tuple[memoryview, ...]) -> int:
    """`block_checksum` of a block, given whole or as consecutive buffers."""
    if not isinstance(block, tuple):
        return block_checksum(key, block)
    digest = xxhash.xxh3_64(seed=xxhash.xxh3_64_intdigest(key))
    for part in block:
        digest.update(part)
    return digest.intdigest()


def _status(status: int) -> GrantStatus | None:
    """A node's grant status as the enum; None for one this client does not know (a newer node)."""
    return GrantStatus(status) if status in GrantStatus._value2member_map_ else None


def _rejection(status: int) -> str:
    """The counter a put refused with `status` adds to."""
    known = status in GrantStatus._value2member_map_
    return f"put_rejected_{GrantStatus(status).name.lower() if known else status}"


def _rdma_transport(link: NodeLink, verbs: str) -> Transport:
    from kvtier.pool.client.rdma import RDMATransport  # verbs only where RDMA is used

    return RDMATransport(link, verbs=verbs)
