"""`PoolNode`: the memory node daemon — sockets and threads around a `BlockStore` and an `Arena`.

One thread accepts (`admission.Admission`: the connection, handshake and authentication bounds);
one thread serves each admitted connection (its socket I/O releases the GIL, and a slow or stalled
peer only ever holds its own thread). Every request runs the store under one lock; block bytes
move outside it, straight between the socket and the arena, while the block is marked busy so that
it cannot be evicted or its slot reused. A connection must authenticate first; a frame that breaks
the protocol gets an error reply and closes that connection only; the leases a connection took end
when it closes. STATS shows a tenant its own use and counters and the node's static facts; only an
operator (`Tenant.operator`) sees node-wide figures, as the node's metrics endpoint does.
A tenant's shared-tier KV events (ANNOUNCE, SUBSCRIBE) go to its own subscribers only (`events`).
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from kvtier.pool import wire
from kvtier.pool.node.admission import Admission, AuthThrottle, Limits
from kvtier.pool.node.arena import Arena
from kvtier.pool.node.blocks import Access, Region
from kvtier.pool.buffers import block_checksum
from kvtier.pool.node.control import CONTROL, Session, commit
from kvtier.pool.node.config import NodeConfig
from kvtier.pool.node.events import EventHub
from kvtier.pool.node.fair_lock import FairLock
from kvtier.pool.node.memory import LeaseReaper, pin_malloc_thresholds
from kvtier.pool.node.multi_put import serve_multi_put
from kvtier.pool.node.subscribe import serve_subscription
from kvtier.pool.protocol import (
    MAX_INLINE_BYTES,
    REPLY,
    ErrorCode,
    GrantStatus,
    MsgType,
    Prefix,
    ProtocolError,
    check_announce,
    encode_error,
    encode_hits,
)
from kvtier.pool.node.store import AccessError, BlockStore
from kvtier.pool.tenants import Tenant

__all__ = ["NodeConfig", "PoolNode", "Session"]
log = logging.getLogger(__name__)


class PoolNode:
    """A running pool node. `start()` binds and serves in background threads; `stop()` ends it."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        quotas = {t.name: t.quota_bytes for t in config.tenants.values()}
        self.events = EventHub(config.events, quotas)
        self.store = BlockStore(config.capacity_bytes, config.region_bytes,
                                quotas, time.monotonic,
                                config.max_lease_s, id_base=int.from_bytes(os.urandom(5), "little") << 20,
                                scrub=self._scrub, max_leases_per_owner=config.max_leases_per_connection,
                                max_leases_per_tenant=config.max_leases_per_tenant,
                                on_remove=self.events.on_remove, max_retain_s=config.max_retain_s,
                                retain_fraction=config.retain_fraction)
        self.arena = Arena(self.store.capacity_bytes, config.hugepages)
        self.rdma = None
        if config.transport == "rdma":
            from kvtier.pool.node.rdma import RdmaNode  # pyverbs only where RDMA is used
            self.rdma = RdmaNode(self.arena, self.store, config.verbs)
        self._lock = FairLock()  # the store's: first come, first served (see fair_lock)
        self._conns: dict[socket.socket, threading.Lock] = {}
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._door: Admission | None = None
        self._next_owner = 0
        self._started = time.monotonic()
        self.counters = {"protocol_errors": 0, "malloc_trims": 0}
        self._data = {MsgType.WRITE: self._write, MsgType.WRITE_COMMIT: self._write, MsgType.PUT: self._put,
                      MsgType.READ: self._read, MsgType.GET: self._get,  # requests that move block bytes
                      MsgType.MULTI_PUT: self._multi_put}
        self._streams = {MsgType.SUBSCRIBE: serve_subscription}  # requests that turn the connection into a stream
        self._control = {**{msg: functools.partial(handler, self.store) for msg, handler in CONTROL.items()},
                         MsgType.RDMA_REGIONS: lambda s, h: {"regions": self.rdma.regions(s.tenant)},
                         MsgType.ANNOUNCE: self._announce}
        if self.rdma is not None:  # one-sided writes: a commit is checked against the bytes that landed
            self._control[MsgType.PUT_COMMIT] = lambda s, h: commit(self.store, s, h, self._holds)

    def _holds(self, block, checksum: int) -> bool:
        """Whether a block written one-sided holds the bytes its writer's `checksum` names (lock held:
        one hash of the block, the price of a commit the node cannot otherwise check)."""
        at = block.region.base + block.offset
        return block_checksum(block.key, self.arena.view[at: at + block.length]) == checksum

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def start(self) -> tuple[str, int]:
        """Binds the listening socket and starts accepting. Returns the bound (host, port).

        Raises:
            OSError: the address cannot be bound.
        """
        c = self.config
        family = socket.AF_INET6 if ":" in c.host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((c.host, c.port))
        self._listener.listen(512)
        throttle = AuthThrottle(time.monotonic, free_failures=c.auth_free_failures, max_backoff_s=c.auth_max_backoff_s)
        welcome = {"node": c.node_id, "transport": c.transport, "max_payload": self.store.region_bytes,
                   "lease_s": c.lease_s}
        self._door = Admission(self._listener, Limits(c.max_connections, c.max_handshakes, c.handshake_timeout_s),
                               c.tenants, welcome, throttle, self._accepted)
        self._spawn(self._door.run, "kvtier-pool-accept")
        pin_malloc_thresholds()  # the node's process is the memory node's: see `memory`
        self._spawn(LeaseReaper(self.store, self._lock, self._stopping, self.counters).run, "kvtier-pool-expire")
        self._spawn(self.events.run, "kvtier-pool-events", self._stopping)
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, lets each connection finish the request it is serving (up to
        `timeout_s`), closes every connection and frees the memory. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.events.close()  # subscribers' streams end within their poll; the flusher returns
        if self._door is not None:
            self._door.stop()
        deadline = time.monotonic() + timeout_s
        with self._lock:
            conns = list(self._conns.items())
        for sock, busy in conns:
            got = busy.acquire(timeout=max(deadline - time.monotonic(), 0))
            _shutdown(sock)
            if got:
                busy.release()
        for t in list(self._threads):
            t.join(max(deadline - time.monotonic(), 0.1))
        if not any(t.is_alive() for t in self._threads):
            if self.rdma is not None:
                self.rdma.close()
            self.arena.close()
            if self._door is not None:
                self._door.close()

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """The node-wide view (the operator's and the metrics endpoint's): capacity, use, every
        counter, connections and the active transport; with `tenant`, also its own figures."""
        with self._lock:
            door = self._door.counters if self._door is not None else {}
            return {**self._static_facts(), "scope": "node", **self.store.stats(tenant), **self.counters, **door,
                    **self.events.stats(),
                    "active_connections": len(self._conns),
                    "handshakes_pending": self._door.num_pending if self._door is not None else 0}

    def tenant_stats(self, tenant: str) -> dict[str, Any]:
        """What `tenant` may see: the node's static facts and its own use, quota and counters."""
        with self._lock:
            return {**self._static_facts(), "scope": "tenant", **self.store.tenant_stats(tenant),
                    **self.events.stats(tenant)}

    def _static_facts(self) -> dict[str, Any]:
        return {"node": self.config.node_id, "transport": self.config.transport,
                "transport_reason": self.config.transport_reason, "memory": self.arena.description,
                "hugepages": self.arena.hugepages, "uptime_s": round(time.monotonic() - self._started, 3)}

    def _scrub(self, region: Region, start: int, length: int, hand_over: bool) -> int:
        """The store's `Scrub` (called with the lock held): zeroes node memory. A region handed to
        another tenant over RDMA gets a new registration as well (`RdmaNode.rekey`)."""
        if hand_over and self.rdma is not None:
            return self.rdma.rekey(region)
        self.arena.zero(region.base + start, length)
        return length

    # ---- connections ------------------------------------------------------------------------

    def _spawn(self, target, name: str, *args) -> None:
        t = threading.Thread(target=self._run_thread, args=(target, *args), name=name, daemon=True)
        self._threads.add(t)
        t.start()

    def _run_thread(self, target, *args) -> None:
        try:
            target(*args)
        finally:
            self._threads.discard(threading.current_thread())

    def _accepted(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        """`Admission`'s hand-over of a connection it admitted: its own thread serves it."""
        with self._lock:
            self._conns[sock] = threading.Lock()
        try:
            self._spawn(self._serve, f"kvtier-pool-conn-{peer}", sock, peer, deadline)
        except BaseException:
            with self._lock:
                self._conns.pop(sock, None)
            raise

    def _serve(self, sock: socket.socket, peer: Any, deadline: float) -> None:
        busy = self._conns[sock]
        frames = wire.FrameSocket(sock, self.config.handshake_timeout_s)
        session = None
        try:
            tenant = self._door.handshake(frames, sock, peer, deadline)
            session = self._session(tenant)
            frames.set_timeout(self.config.idle_timeout_s)  # a stalled peer costs one thread that long
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            while not self._stopping.is_set():
                self._serve_one(frames, session, busy)
            self._reply_error(sock, 0, ErrorCode.SHUTTING_DOWN, "node is shutting down")
        except ProtocolError as e:
            with self._lock:
                self.counters["protocol_errors"] += 1
            self._reply_error(sock, e.request_id, e.code, str(e))
        except (EOFError, OSError):
            pass  # the peer went away or timed out: nothing to tell it
        except Exception as e:  # a bug: keep serving everyone else, tell this peer
            log.exception("pool node: connection failed")
            self._reply_error(sock, 0, ErrorCode.INTERNAL, f"internal error: {type(e).__name__}")
        finally:
            self._door.closed(sock)
            with self._lock:
                self._conns.pop(sock, None)
                if session is not None:
                    self.store.disconnect(session.owner)
            if self.rdma is not None:
                self.rdma.disconnect(sock)
            wire.linger_close(sock)

    def _serve_one(self, frames: wire.FrameSocket, session: Session, busy: threading.Lock) -> None:
        """Reads one request and serves it. (A function of its own so that the request's header
        is gone when it returns, not kept while the connection waits for the next one: 4,096
        keys of a GET are 200 KB.)"""
        prefix, msg, header = frames.read_head(self.store.region_bytes, reply=False)
        stream = self._streams.get(msg)
        if stream is not None:  # outside `busy`: a stream is no request that `stop` should wait for
            return stream(self.events, frames, session.tenant, prefix.request_id, header, self._stopping)
        with busy:
            self._dispatch(frames, session, prefix, msg, header)

    def _session(self, tenant: Tenant) -> Session:
        with self._lock:
            self._next_owner += 1
            return Session(tenant.name, self._next_owner, tenant.operator)

    def _reply_error(self, sock: socket.socket, request_id: int, code: ErrorCode, message: str) -> None:
        try:
            sock.settimeout(1.0)
            sock.sendall(encode_error(request_id, code, message))
        except OSError:
            pass

    # ---- requests ---------------------------------------------------------------------------

    def _dispatch(self, frames: wire.FrameSocket, session: Session, prefix: Prefix, msg: MsgType, header: dict) -> None:
        rid = prefix.request_id
        data = self._data.get(msg)
        if data is not None:
            return data(frames, session, msg, rid, header, prefix.payload_len)
        if msg in (MsgType.RDMA_CONNECT, MsgType.RDMA_REGIONS) and self.rdma is None:
            return _send_error(frames, rid, ErrorCode.FORBIDDEN, f"this node's data plane is "
                                                                 f"{self.config.transport}, not rdma")
        if msg is MsgType.STATS:  # the node-wide view for an operator, the tenant's own otherwise
            stats = self.stats(session.tenant) if session.operator else self.tenant_stats(session.tenant)
            return frames.send(REPLY | msg, rid, {"stats": stats})
        if msg is MsgType.RDMA_CONNECT:
            with self._lock:  # the region table must not change while it is read
                reply = self.rdma.connect(frames.sock, session.tenant, header)
            return frames.send(REPLY | msg, rid, reply)
        handler = self._control.get(msg)
        if handler is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} is not valid after authentication", rid)
        with self._lock:
            reply = handler(session, header)
        frames.send(REPLY | msg, rid, reply)

    def _announce(self, s: Session, h: dict) -> dict:
        """ANNOUNCE (lock held): the engine's hashes of the tenant's READY blocks (`EventHub.announce`)."""
        check_announce(h)
        return self.events.announce(s.tenant, self.store.find(s.tenant, h["keys"]), h)

    def _receive_block(self, frames: wire.FrameSocket, access: Access, finish: Callable[[bool], Any]) -> Any:
        """The one place block bytes come in: `access.length` payload bytes from the socket straight
        into the arena at `access` (the block is busy meanwhile), then, under the lock, the access
        ends and `finish(every byte arrived)` runs; returns what it returns. A connection that
        breaks mid-block raises after `finish(False)`."""
        ok = False
        try:
            frames.recv_into(self.arena.view[access.arena_offset: access.arena_offset + access.length])
            ok = True
        finally:
            with self._lock:
                self.store.end_access(access, ok)
                if ok:
                    self.store.count(access.block.tenant, "bytes_in", access.length)
                result = finish(ok)
        return result

    def _write(self, frames: wire.FrameSocket, s: Session, msg: MsgType, rid: int, h: dict, n: int) -> None:
        """WRITE / WRITE_COMMIT: one-sided, at a location the client names (checked by the store)."""
        try:
            with self._lock:
                access = self.store.begin_access(s.tenant, h["region"], h["offset"], n, h["gen"], write=True)
        except AccessError as e:
            frames.drain(n)
            return _send_error(frames, rid, e.code, str(e))

        def finish(ok: bool) -> dict:
            if ok and msg is MsgType.WRITE_COMMIT:
                return {"committed": self.store.commit(s.tenant, access.block.key, h["gen"], h["checksum"])}
            return {}

        frames.send(REPLY | msg, rid, self._receive_block(frames, access, finish))

    def _put(self, frames: wire.FrameSocket, s: Session, msg: MsgType, rid: int, h: dict, n: int) -> None:
        """PUT_BEGIN and WRITE_COMMIT of one block in one frame: the bytes go straight from the socket
        into the slot granted, or (a key already stored, no room) are drained and the status told.

        Why the bytes come unasked: asking first (PUT_BEGIN) costs every put a round trip to save
        the bytes of a block the node holds already, and engines look keys up before they compute
        and store blocks, so a duplicate is the exception (servers racing on one prefix). The price
        stays visible: `duplicate_put_bytes` (stats, metrics) counts the bytes drained for stored keys.
        The write lease has no owner: it ends within this frame, which the connection's thread serves.
        """
        with self._lock:
            grant = self.store.put_begin(s.tenant, h["key"], n, h["lease_s"])
            block = grant.block
            access = None if block is None else self.store.pin(block, write=True)
            if grant.status is GrantStatus.EXISTS:
                self.store.count(s.tenant, "duplicate_put_bytes", n)
        if access is None:
            frames.drain(n)
            return frames.send(REPLY | MsgType.PUT, rid, {"status": int(grant.status), "stored": False})

        def finish(ok: bool) -> bool:
            if ok:
                return self.store.commit(s.tenant, block.key, block.gen, h["checksum"])
            self.store.abort(s.tenant, block.key, block.gen)  # the peer went away mid-block: free the slot now
            return False

        stored = self._receive_block(frames, access, finish)
        frames.send(REPLY | MsgType.PUT, rid, {"status": int(grant.status), "stored": stored})

    def _multi_put(self, frames: wire.FrameSocket, s: Session, msg: MsgType, rid: int, h: dict, n: int) -> None:
        """MULTI_PUT: `_put` of many blocks in one frame (see `multi_put`)."""
        serve_multi_put(self.store, self.arena, self._lock, frames, s.tenant, rid, h, n)

    def _read(self, frames: wire.FrameSocket, s: Session, msg: MsgType, rid: int, h: dict, _: int) -> None:
        n = h["length"]
        try:
            with self._lock:
                access = self.store.begin_access(s.tenant, h["region"], h["offset"], n, h["gen"], write=False)
        except AccessError as e:
            return _send_error(frames, rid, e.code, str(e))
        self._send_blocks(frames, REPLY | MsgType.READ, rid, {}, [access])

    def _send_blocks(self, frames: wire.FrameSocket, msg: int, rid: int, header: dict | bytes,
                     accesses: list[Access]) -> None:
        """A reply whose payload is the bytes of `accesses`, sent from the arena; then the accesses end."""
        views = [self.arena.view[a.arena_offset: a.arena_offset + a.length] for a in accesses]
        ok = False
        try:
            frames.send(msg, rid, header, views)
            ok = True
        finally:
            with self._lock:
                for access in accesses:
                    self.store.end_access(access, ok)
                    if ok:
                        self.store.count(access.block.tenant, "bytes_out", access.length)

    def _get(self, frames: wire.FrameSocket, s: Session, msg: MsgType, rid: int, h: dict, _: int) -> None:
        """Looks keys up; each hit is leased for a one-sided READ or, inline, sent in the reply. A
        GET whose leases would pass the connection's or the tenant's bound leases nothing and is
        answered LIMIT (its releases still count)."""
        store = self.store
        try:
            with self._lock:
                store.release(s.tenant, h["release"])
                if not h["inline"]:
                    store.check_hits_room(s.tenant, s.owner, h["keys"])
                ids = store.find(s.tenant, h["keys"])
                inline = store.plan_inline(ids, MAX_INLINE_BYTES if h["inline"] else 0)
                store.check_lease_room(s.tenant, s.owner, len(ids) - ids.count(-1) - sum(inline))
                rows, pinned = store.answer_get(s.tenant, ids, inline, h["lease_s"], s.owner)
        except AccessError as e:
            return _send_error(frames, rid, e.code, str(e))
        reply = encode_hits(rows, len(ids))  # outside the lock (see `answer_get`)
        self._send_blocks(frames, REPLY | MsgType.GET, rid, reply, pinned)


def _send_error(frames: wire.FrameSocket, rid: int, code: ErrorCode, message: str) -> None:
    """A non-fatal error reply to one request: the connection goes on."""
    frames.send(MsgType.ERROR, rid, {"code": int(code), "message": message[:4096]})


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
