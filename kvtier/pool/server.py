"""`PoolNode`: the memory node daemon — sockets and threads around a `BlockStore` and an `Arena`.

One thread accepts; one thread serves each connection (its socket I/O releases the GIL, and a slow
or stalled peer only ever holds its own thread). Every request runs the store under one lock; block
bytes move outside it, straight between the socket and the arena, while the block is marked busy so
that it cannot be evicted or its slot reused. A connection must authenticate first; a frame that
breaks the protocol gets an error reply and closes that connection only.
"""

from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.pool import wire
from kvtier.pool.arena import Arena
from kvtier.pool.blocks import Access
from kvtier.pool.protocol import (
    MAX_HANDSHAKE_HEADER_BYTES,
    MAX_INLINE_BYTES,
    REPLY,
    ErrorCode,
    GrantStatus,
    MsgType,
    Prefix,
    ProtocolError,
    encode_error,
)
from kvtier.pool.store import AccessError, BlockStore, Grant
from kvtier.pool.tenants import Tenant, proof

log = logging.getLogger(__name__)
_NO_SECRET = os.urandom(32)  # what an unknown tenant's proof is checked against: same work, never a match


@dataclass(frozen=True, slots=True)
class NodeConfig:
    """How a node runs. Times in seconds."""

    host: str
    port: int
    capacity_bytes: int
    tenants: dict[str, Tenant]
    region_bytes: int = 64 << 20
    transport: str = "tcp"
    transport_reason: str = "requested"
    hugepages: bool = False
    lease_s: float = 10.0  # read lease when a client asks for none longer
    max_lease_s: float = 60.0
    max_connections: int = 1024
    handshake_timeout_s: float = 10.0
    idle_timeout_s: float = 600.0
    node_id: str = field(default_factory=lambda: os.urandom(4).hex())


class PoolNode:
    """A running pool node. `start()` binds and serves in background threads; `stop()` ends it."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = BlockStore(config.capacity_bytes, config.region_bytes,
                                {t.name: t.quota_bytes for t in config.tenants.values()}, time.monotonic,
                                config.max_lease_s, id_base=int.from_bytes(os.urandom(5), "little") << 20)
        self.arena = Arena(self.store.capacity_bytes, config.hugepages)
        self.rdma = None
        if config.transport == "rdma":
            from kvtier.pool.rdma_node import RdmaNode  # pyverbs only where RDMA is used
            self.rdma = RdmaNode(self.arena, self.store)
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Lock] = {}
        self._threads: set[threading.Thread] = set()
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = os.pipe()
        self._started = time.monotonic()
        self.counters = dict.fromkeys(("connections", "auth_failures", "protocol_errors", "refused_busy",
                                       "bytes_in", "bytes_out", "duplicate_put_bytes"), 0)
        self._data = {MsgType.WRITE: self._write, MsgType.WRITE_COMMIT: self._write, MsgType.PUT: self._put,
                      MsgType.READ: self._read, MsgType.GET: self._get}  # requests that move block bytes
        self._control = {MsgType.PUT_BEGIN: self._put_begin, MsgType.ALLOC: self._alloc,
                         MsgType.PUT_COMMIT: self._commit, MsgType.PUT_ABORT: self._abort,
                         MsgType.RELEASE: self._release,
                         MsgType.CONTAINS: self._contains, MsgType.DELETE: self._delete,
                         MsgType.STATS: self._stats, MsgType.RDMA_REGIONS: self._rdma_regions}

    @property
    def address(self) -> tuple[str, int]:
        return self._listener.getsockname()[:2]

    def start(self) -> tuple[str, int]:
        """Binds the listening socket and starts accepting. Returns the bound (host, port).

        Raises:
            OSError: the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((self.config.host, self.config.port))
        self._listener.listen(512)
        self._spawn(self._accept_loop, "kvtier-pool-accept")
        return self.address

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stops accepting, lets each connection finish the request it is serving (up to
        `timeout_s`), closes every connection and frees the memory. Idempotent."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
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
        os.close(self._wake_r)
        os.close(self._wake_w)

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        """Capacity, use, hit/miss/eviction counters, connections and the active transport."""
        with self._lock:
            return self._facts(tenant)

    def _facts(self, tenant: str | None) -> dict[str, Any]:
        """`stats()` with the lock held."""
        return {"node": self.config.node_id, "transport": self.config.transport,
                "transport_reason": self.config.transport_reason, "memory": self.arena.description,
                "hugepages": self.arena.hugepages, "uptime_s": round(time.monotonic() - self._started, 3),
                **self.store.stats(tenant), **self.counters, "active_connections": len(self._conns)}

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

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                if any(key.fileobj is not self._listener for key, _ in sel.select()):
                    break
                try:
                    sock, peer = self._listener.accept()
                except OSError:
                    continue
                self._admit(sock, peer)
        self._listener.close()

    def _admit(self, sock: socket.socket, peer: Any) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            full = len(self._conns) >= self.config.max_connections
            if full:
                self.counters["refused_busy"] += 1
            else:
                self._conns[sock] = threading.Lock()
                self.counters["connections"] += 1
        self._spawn(self._refuse if full else self._serve, f"kvtier-pool-conn-{peer}", sock)

    def _refuse(self, sock: socket.socket) -> None:
        """Tells a connection over the limit BUSY; on its own thread so accepting never waits."""
        self._reply_error(sock, 0, ErrorCode.BUSY, "node at its connection limit")
        wire.linger_close(sock)

    def _serve(self, sock: socket.socket) -> None:
        busy = self._conns[sock]
        frames = wire.FrameSocket(sock, self.config.handshake_timeout_s)
        try:
            tenant = self._handshake(frames)
            frames.set_timeout(self.config.idle_timeout_s)  # a stalled peer costs one thread that long
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            while not self._stopping.is_set():
                prefix, msg, header = frames.read_head(self.store.region_bytes, reply=False)
                with busy:
                    self._dispatch(frames, tenant, prefix, msg, header)
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
            with self._lock:
                self._conns.pop(sock, None)
            if self.rdma is not None:
                self.rdma.disconnect(sock)
            wire.linger_close(sock)

    def _reply_error(self, sock: socket.socket, request_id: int, code: ErrorCode, message: str) -> None:
        try:
            sock.settimeout(1.0)
            sock.sendall(encode_error(request_id, code, message))
        except OSError:
            pass

    def _handshake(self, frames: wire.FrameSocket) -> str:
        prefix, msg, hello = frames.read_head(0, reply=False, max_header=MAX_HANDSHAKE_HEADER_BYTES)
        if msg is not MsgType.HELLO:
            raise ProtocolError(ErrorCode.AUTH, f"expected HELLO first, got {msg.name}", prefix.request_id)
        nonce = os.urandom(32)
        frames.send(REPLY | MsgType.HELLO, prefix.request_id, {"nonce": nonce, "node": self.config.node_id})
        prefix, msg, auth = frames.read_head(0, reply=False, max_header=MAX_HANDSHAKE_HEADER_BYTES)
        name = hello["tenant"]
        tenant = self.config.tenants.get(name)
        expected = proof(tenant.secret if tenant else _NO_SECRET, b"client", name, hello["nonce"], nonce)
        if msg is not MsgType.AUTH or tenant is None or not hmac.compare_digest(expected, auth["mac"]):
            with self._lock:
                self.counters["auth_failures"] += 1
            raise ProtocolError(ErrorCode.AUTH, "authentication failed (unknown tenant or wrong secret)",
                                prefix.request_id)
        frames.send(REPLY | MsgType.AUTH, prefix.request_id, {
            "mac": proof(tenant.secret, b"node", name, hello["nonce"], nonce), "node": self.config.node_id,
            "transport": self.config.transport, "max_payload": self.store.region_bytes,
            "lease_s": self.config.lease_s})
        return name

    # ---- requests ---------------------------------------------------------------------------

    def _dispatch(self, frames: wire.FrameSocket, tenant: str, prefix: Prefix, msg: MsgType, header: dict) -> None:
        rid = prefix.request_id
        data = self._data.get(msg)
        if data is not None:
            return data(frames, tenant, msg, rid, header, prefix.payload_len)
        if msg in (MsgType.RDMA_CONNECT, MsgType.RDMA_REGIONS) and self.rdma is None:
            return _send_error(frames, rid, ErrorCode.FORBIDDEN, f"this node's data plane is "
                                                                 f"{self.config.transport}, not rdma")
        if msg is MsgType.RDMA_CONNECT:
            with self._lock:  # the region table must not change while it is read
                reply = self.rdma.connect(frames.sock, tenant, header)
            return frames.send(REPLY | msg, rid, reply)
        handler = self._control.get(msg)
        if handler is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} is not valid after authentication", rid)
        with self._lock:
            reply = handler(tenant, header)
        frames.send(REPLY | msg, rid, reply)

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
                self.counters["bytes_in"] += access.length if ok else 0
                result = finish(ok)
        return result

    def _write(self, frames: wire.FrameSocket, tenant: str, msg: MsgType, rid: int, h: dict, n: int) -> None:
        """WRITE / WRITE_COMMIT: one-sided, at a location the client names (checked by the store)."""
        try:
            with self._lock:
                access = self.store.begin_access(tenant, h["region"], h["offset"], n, h["gen"], write=True)
        except AccessError as e:
            frames.drain(n)
            return _send_error(frames, rid, e.code, str(e))

        def finish(ok: bool) -> dict:
            if ok and msg is MsgType.WRITE_COMMIT:
                return {"committed": self.store.commit(tenant, access.block.key, h["gen"], h["checksum"])}
            return {}

        frames.send(REPLY | msg, rid, self._receive_block(frames, access, finish))

    def _put(self, frames: wire.FrameSocket, tenant: str, msg: MsgType, rid: int, h: dict, n: int) -> None:
        """PUT_BEGIN and WRITE_COMMIT of one block in one frame: the bytes go straight from the socket
        into the slot granted, or (a key already stored, no room) are drained and the status told.

        Why the bytes come unasked: asking first (PUT_BEGIN) costs every put a round trip to save
        the bytes of a block the node holds already, and engines look keys up before they compute
        and store blocks, so a duplicate is the exception (servers racing on one prefix). The price
        stays visible: `duplicate_put_bytes` (stats, metrics) counts the bytes drained for stored keys.
        """
        with self._lock:
            grant = self.store.put_begin(tenant, h["key"], n, h["lease_s"])
            block = grant.block
            access = None if block is None else self.store.pin(block, write=True)
            if grant.status is GrantStatus.EXISTS:
                self.counters["duplicate_put_bytes"] += n
        if access is None:
            frames.drain(n)
            return frames.send(REPLY | MsgType.PUT, rid, {"status": int(grant.status), "stored": False})

        def finish(ok: bool) -> bool:
            if ok:
                return self.store.commit(tenant, block.key, block.gen, h["checksum"])
            self.store.abort(tenant, block.key, block.gen)  # the peer went away mid-block: free the slot now
            return False

        stored = self._receive_block(frames, access, finish)
        frames.send(REPLY | MsgType.PUT, rid, {"status": int(grant.status), "stored": stored})

    def _read(self, frames: wire.FrameSocket, tenant: str, msg: MsgType, rid: int, h: dict, _: int) -> None:
        n = h["length"]
        try:
            with self._lock:
                access = self.store.begin_access(tenant, h["region"], h["offset"], n, h["gen"], write=False)
        except AccessError as e:
            return _send_error(frames, rid, e.code, str(e))
        self._send_blocks(frames, REPLY | MsgType.READ, rid, {}, [access])

    def _send_blocks(self, frames: wire.FrameSocket, msg: int, rid: int, header: dict, accesses: list[Access]) -> None:
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
                self.counters["bytes_out"] += sum(a.length for a in accesses) if ok else 0

    def _put_begin(self, tenant: str, h: dict) -> dict:
        return {"grants": [_grant(self.store.put_begin(tenant, k, n, h["lease_s"]))
                           for k, n in zip(h["keys"], h["lengths"])]}

    def _alloc(self, tenant: str, h: dict) -> dict:
        return {"grants": [_grant(self.store.alloc(tenant, k, n)) for k, n in zip(h["keys"], h["lengths"])]}

    def _commit(self, tenant: str, h: dict) -> dict:
        return {"ok": [self.store.commit(tenant, k, g, c) for k, g, c in zip(h["keys"], h["gens"], h["checksums"])]}

    def _abort(self, tenant: str, h: dict) -> dict:
        for k, g in zip(h["keys"], h["gens"]):
            self.store.abort(tenant, k, g)
        return {}

    def _get(self, frames: wire.FrameSocket, tenant: str, msg: MsgType, rid: int, h: dict, _: int) -> None:
        """Looks keys up; each hit is leased for a one-sided READ or, inline, sent in the reply."""
        hits, pinned, budget = [], [], MAX_INLINE_BYTES if h["inline"] else 0
        with self._lock:
            self.store.release(tenant, h["release"])
            for b in self.store.lookup(tenant, h["keys"]):
                if b is None:
                    hits.append([False, 0, 0, 0, 0, 0, 0, False])
                    continue
                inline = b.length <= budget
                if inline:
                    budget -= b.length
                    pinned.append(self.store.pin(b))
                lease = 0 if inline else self.store.lease(b, h["lease_s"])
                hits.append([True, b.region.id, b.offset, b.length, b.gen, b.checksum, lease, inline])
        self._send_blocks(frames, REPLY | MsgType.GET, rid, {"hits": hits}, pinned)

    def _release(self, tenant: str, h: dict) -> dict:
        self.store.release(tenant, h["leases"])
        return {}

    def _contains(self, tenant: str, h: dict) -> dict:
        return {"found": self.store.contains(tenant, h["keys"])}

    def _delete(self, tenant: str, h: dict) -> dict:
        return {"deleted": self.store.delete(tenant, h["keys"])}

    def _rdma_regions(self, tenant: str, h: dict) -> dict:
        return {"regions": self.rdma.regions(tenant)}

    def _stats(self, tenant: str, h: dict) -> dict:
        return {"stats": self._facts(tenant)}


def _grant(g: Grant) -> list[int]:
    b = g.block
    return [int(g.status), b.region.id, b.offset, b.gen, g.lease] if b is not None else [int(g.status), 0, 0, 0, 0]


def _send_error(frames: wire.FrameSocket, rid: int, code: ErrorCode, message: str) -> None:
    """A non-fatal error reply to one request: the connection goes on."""
    frames.send(MsgType.ERROR, rid, {"code": int(code), "message": message[:4096]})


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
