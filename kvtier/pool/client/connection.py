"""The client's side of the control connection: one authenticated socket to one node, and a
`NodeLink` that pools such sockets and remembers whether the node is reachable.

Every call carries a deadline (`timeout_s` from its start). Whatever goes wrong on the way — a
refused connection, a timeout, a reset, a frame that breaks the protocol, a fatal error reply —
closes that socket and raises `NodeUnavailable`; the caller turns it into misses. A node that
failed is skipped (calls fail at once) for `reconnect_s`, then tried afresh, so a restarted node
rejoins without anyone noticing more than a few misses.
"""

from __future__ import annotations

import hmac
import logging
import os
import select
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvtier.errors import TransferError
from kvtier.pool import wire
from kvtier.pool.protocol import FATAL, ErrorCode, MsgType, ProtocolError
from kvtier.pool.tenants import proof

PIPELINE_DEPTH = 64  # requests in flight on one socket: bounded so neither side's buffers fill up
# MULTI_PUT of nothing: sent behind AUTH by a link that does not know yet whether its node serves
# MULTI_PUT (a node older than the message answers MALFORMED and closes: see `NodeLink`)
_MULTI_PUT_PROBE = {"keys": [], "lengths": [], "checksums": [], "lease_s": 0}
log = logging.getLogger(__name__)


class NodeUnavailable(TransferError):
    """A node could not be reached, timed out or broke the protocol; its blocks are misses.
    `code`: the fatal error the node itself replied, if that is why (None otherwise)."""

    code: ErrorCode | None = None


class _PeerFatal(ProtocolError):
    """A fatal error reply from the node (as opposed to a frame this side found bad)."""


class AuthFailed(NodeUnavailable):
    """The node refused this tenant's credentials, or failed to prove it knows the secret."""


class RemoteError(Exception):
    """A non-fatal error reply to one request (STALE, BOUNDS, FORBIDDEN, LIMIT); the socket stays usable."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code


@dataclass(slots=True)  # not frozen: every call builds one, and frozen construction costs 4x
class Request:
    """One request. `payload`: the bytes sent after the header, one buffer or several in order.
    `into` is where the reply's payload goes: a buffer of exactly its size (READ), or (GET inline)
    a function from the reply header to the buffers, in order, that it fills; `max_reply_payload`
    bounds what the node may send then. `landed(j)` is called as soon as buffer j of `into` is
    filled (the bytes of a block arrive in order: a reader can use its first layers while the
    rest is still on the wire); it must not raise. `summed(j)`: the `LayerSums` to compute as
    buffer j of `into` lands (None: none), hashed in the same native pass as the receive."""

    msg: MsgType
    header: dict[str, Any]
    payload: memoryview | tuple[memoryview, ...] | None = None
    into: memoryview | Callable[[dict[str, Any]], list[memoryview]] | None = None
    max_reply_payload: int = 0
    landed: Callable[[int], None] | None = None
    summed: Callable[[int], Any] | None = None


class NodeConnection:
    """One authenticated socket. Not thread-safe: a `NodeLink` lends it to one caller at a time.

    Raises (constructor):
        NodeUnavailable: the node cannot be reached or timed out.
        AuthFailed: the node refused the credentials or could not prove its own.
    """

    def __init__(self, name: str, address: tuple[str, int], tenant: str, secret: bytes, timeout_s: float,
                 probe_multi_put: bool = False) -> None:
        self.name, self.timeout_s = name, timeout_s
        self._next_id = 0
        self.max_payload = 0
        self.multi_put: bool | None = None  # whether the node serves MULTI_PUT, where `probe_multi_put` asked
        try:
            self.sock = socket.create_connection(address, timeout=timeout_s)
        except OSError as e:
            raise NodeUnavailable(f"pool node {name}: cannot connect: {e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.frames = wire.FrameSocket(self.sock, timeout_s)  # each call then keeps its own deadline
        self._readable = select.poll()  # registered once: a check before each loan costs one poll(0)
        self._readable.register(self.sock, select.POLLIN)
        try:
            self._handshake(tenant, secret, probe_multi_put)
        except BaseException:
            self.close()
            raise

    def _handshake(self, tenant: str, secret: bytes, probe_multi_put: bool) -> None:
        """HELLO, then AUTH (and, with `probe_multi_put`, an empty MULTI_PUT in the same round trip).

        Raises:
            NodeUnavailable: as `call`; with code MALFORMED after a probe: the node does not know MULTI_PUT.
        """
        nonce = os.urandom(32)
        hello = self.call(MsgType.HELLO, {"tenant": tenant, "nonce": nonce})
        requests = [Request(MsgType.AUTH, {"mac": proof(secret, b"client", tenant, nonce, hello["nonce"])})]
        if probe_multi_put:
            requests.append(Request(MsgType.MULTI_PUT, _MULTI_PUT_PROBE))
        try:
            replies = self.call_many(requests)
        except AuthFailed:
            raise AuthFailed(f"pool node {self.name} refused tenant {tenant!r}: authentication failed") from None
        welcome = replies[0]
        if isinstance(welcome, RemoteError):
            raise NodeUnavailable(f"pool node {self.name}: AUTH: {welcome}")
        if probe_multi_put:
            self.multi_put = not isinstance(replies[1], RemoteError)
        if not hmac.compare_digest(welcome["mac"], proof(secret, b"node", tenant, nonce, hello["nonce"])):
            raise AuthFailed(f"pool node {self.name} could not prove it knows tenant {tenant!r}'s secret")
        self.node_id, self.transport = welcome["node"], welcome["transport"]
        self.max_payload, self.lease_s = welcome["max_payload"], welcome["lease_s"]

    @property
    def closed(self) -> bool:
        return self.sock.fileno() < 0

    def peer_closed(self) -> bool:
        """True when the node closed this (idle) socket, e.g. because it restarted."""
        if self.closed or self.frames.buffered:
            return True  # closed here, or holding bytes nobody asked for
        try:
            return bool(self._readable.poll(0))  # end of stream, reset, or bytes nobody asked for
        except OSError:
            return True

    def call(self, msg: MsgType, header: dict[str, Any], payload: memoryview | None = None,
             into: memoryview | None = None) -> dict[str, Any]:
        """One request and its reply header.

        Raises:
            RemoteError: a non-fatal error reply.
            NodeUnavailable: as the class says; the socket is closed.
        """
        return self.request(Request(msg, header, payload, into))

    def request(self, request: Request, overlap: Callable[[], None] | None = None) -> dict[str, Any]:
        """`call` of a built `Request`; `overlap` runs while it travels. Raises as `call`."""
        reply = self.call_many([request], overlap)[0]
        if isinstance(reply, RemoteError):
            raise reply
        return reply

    def call_many(self, requests: Sequence[Request],
                  overlap: Callable[[], None] | None = None) -> list[dict[str, Any] | RemoteError]:
        """Pipelines `requests` (up to PIPELINE_DEPTH in flight); one reply or RemoteError each, in order.

        Args:
            overlap: work to do while the first requests travel (e.g. a put's checksums).
        Raises:
            NodeUnavailable: as `call`; no reply of the batch is known then.
        """
        deadline = time.monotonic() + self.timeout_s
        out: list[dict[str, Any] | RemoteError] = []
        try:
            for start in range(0, len(requests), PIPELINE_DEPTH):
                window = requests[start: start + PIPELINE_DEPTH] if len(requests) > PIPELINE_DEPTH else requests
                first = self._next_id + 1
                self._send(window, deadline)
                if overlap is not None:
                    overlap, run = None, overlap
                    run()
                out += [self._receive(r, rid, deadline) for rid, r in enumerate(window, first)]
        except TimeoutError:
            self.close()
            raise NodeUnavailable(f"pool node {self.name}: no answer within {self.timeout_s} s") from None
        except (OSError, EOFError) as e:
            self.close()
            raise NodeUnavailable(f"pool node {self.name}: connection lost: {e or type(e).__name__}") from None
        except ProtocolError as e:
            self.close()
            cls = AuthFailed if e.code is ErrorCode.AUTH else NodeUnavailable
            error = cls(f"pool node {self.name}: {e.code.name}: {e}")
            error.code = e.code if isinstance(e, _PeerFatal) else None
            raise error from None
        return out

    def _send(self, window: Sequence[Request], deadline: float) -> None:
        """The window's frames in as few system calls as the kernel takes (one for a usual batch)."""
        buffers: list = []
        for r in window:
            self._next_id += 1
            payloads = () if r.payload is None else r.payload if isinstance(r.payload, tuple) else (r.payload,)
            buffers += self.frames.frame(r.msg, self._next_id, r.header, payloads)
        self.frames.send_buffers(buffers, deadline)

    def _receive(self, r: Request, rid: int, deadline: float) -> dict[str, Any] | RemoteError:
        limit = r.max_reply_payload if callable(r.into) else len(r.into) if r.into is not None else 0
        prefix, msg, header = self.frames.read_head(limit, reply=True, deadline=deadline)
        if prefix.request_id != rid and not (msg is MsgType.ERROR and prefix.request_id == 0):
            raise ProtocolError(ErrorCode.MALFORMED, f"reply to request {prefix.request_id}, expected {rid}")
        if msg is MsgType.ERROR:
            try:
                code = ErrorCode(header["code"])
            except ValueError:
                code = ErrorCode.INTERNAL
            if code in FATAL or prefix.request_id == 0:
                raise _PeerFatal(code, header["message"])
            return RemoteError(code, header["message"])
        if msg is not r.msg:
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} reply to a {r.msg.name} request")
        if not prefix.payload_len and r.into is None:
            return header
        views = r.into(header) if callable(r.into) else [r.into] if r.into is not None else []
        expected = sum(map(len, views))
        if prefix.payload_len != expected:
            raise ProtocolError(ErrorCode.MALFORMED, f"{msg.name} reply of {prefix.payload_len} bytes, "
                                                     f"expected {expected}")
        for j, view in enumerate(views):
            self.frames.recv_into(view, deadline, None if r.summed is None else r.summed(j))
            if r.landed is not None:
                r.landed(j)
        return header

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


class NodeLink:
    """One node as the client sees it: its address, a pool of idle connections, up or down.

    Args:
        address: "host:port" as configured; also the node's name in placement and messages.
        max_idle: idle connections kept for reuse (more may be open while many threads call).
    """

    def __init__(self, address: str, addr: tuple[str, int], tenant: str, secret: bytes, *,
                 timeout_s: float, reconnect_s: float, max_idle: int = 8) -> None:
        self.name, self._addr = address, addr
        self._tenant, self._secret = tenant, secret
        self.timeout_s, self.reconnect_s, self._max_idle = timeout_s, reconnect_s, max_idle
        self._idle: list[NodeConnection] = []
        self._lock = threading.Lock()
        self._down_until = 0.0
        self.transport: str | None = None  # as the node reported it
        self.multi_put: bool | None = None  # whether the node serves MULTI_PUT (None: not known yet)
        self._serves: dict[MsgType, bool] = {}  # see `serves`
        self.last_error: str | None = None

    @property
    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def revive(self) -> None:
        """Ends the skip period of a node marked down: the next call tries it afresh (a probe)."""
        self._down_until = 0.0

    def connection(self) -> _Loan:
        """Lends a connection for a sequence of calls (`with link.connection() as conn:`).

        Raises:
            NodeUnavailable: the node is marked down or cannot be reached (then it is marked down).
            AuthFailed: the credentials were refused (the node is not marked down: this is loud).
        """
        return _Loan(self)

    def call(self, msg: MsgType, header: dict[str, Any]) -> dict[str, Any]:
        return self.request(Request(msg, header))

    def request(self, request: Request, overlap: Callable[[], None] | None = None) -> dict[str, Any]:
        """One request on a lent connection (`overlap` runs while it travels); raises as
        `connection()` and `NodeConnection.call`."""
        with self.connection() as conn:
            reply = conn.call_many([request], overlap)[0]
        if isinstance(reply, RemoteError):  # raised out here: the connection goes back to the pool
            raise reply
        return reply

    def dedicated(self) -> NodeConnection:
        """A new connection outside the pool, owned (and closed) by the caller: for state tied to
        one connection, such as the node's end of an RDMA queue pair. Raises as `connection()`."""
        if self.down:
            raise NodeUnavailable(f"pool node {self.name}: down ({self.last_error})")
        try:
            return self._connect()
        except AuthFailed:
            raise
        except NodeUnavailable as e:
            self._fail(None, e)
            raise

    def serves(self, msg: MsgType, probe: dict[str, Any]) -> bool:
        """Whether the node serves `msg`, a message added after version 1 shipped (as MULTI_PUT
        was): asked once, with `probe` (a request of that type that changes nothing), on a
        connection of its own, since a node that predates it answers MALFORMED and closes it.

        Raises:
            NodeUnavailable, AuthFailed: as `dedicated`, or the probe failed otherwise.
        """
        known = self._serves.get(msg)
        if known is None:
            conn = self.dedicated()
            try:
                conn.call(msg, probe)
                known = True
            except RemoteError:
                known = True  # refused, but understood
            except NodeUnavailable as e:
                if e.code is not ErrorCode.MALFORMED:
                    raise
                log.warning("pool node %s does not know %s (an older node)", self.name, msg.name)
                known = False
            finally:
                conn.close()
            self._serves[msg] = known
        return known

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _acquire(self) -> NodeConnection:
        if self.down:
            raise NodeUnavailable(f"pool node {self.name}: down ({self.last_error})")
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                break
            if not conn.peer_closed():
                return conn
            conn.close()
        try:
            conn = self._connect()
        except AuthFailed:
            raise
        except NodeUnavailable as e:
            self._fail(None, e)
            raise
        self.transport = conn.transport
        return conn

    def _connect(self) -> NodeConnection:
        """A new authenticated connection; the first one also learns whether the node serves
        MULTI_PUT, in the handshake's last round trip. A node that predates it refuses the probe
        and closes: then it is said once in the log, and a connection made again without it.

        Raises:
            NodeUnavailable, AuthFailed: as `NodeConnection`.
        """
        probe = self.multi_put is None
        try:
            conn = NodeConnection(self.name, self._addr, self._tenant, self._secret, self.timeout_s, probe)
        except AuthFailed:
            raise
        except NodeUnavailable as e:
            if not probe or e.code is not ErrorCode.MALFORMED:
                raise
            log.warning("pool node %s does not know MULTI_PUT (an older node): puts to it go one PUT frame "
                        "per block", self.name)
            self.multi_put = False
            return NodeConnection(self.name, self._addr, self._tenant, self._secret, self.timeout_s)
        if probe:
            self.multi_put = conn.multi_put
        return conn

    def _release(self, conn: NodeConnection) -> None:
        with self._lock:
            if not conn.closed and len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _end_loan(self, conn: NodeConnection, error: BaseException | None) -> None:
        if error is None:
            self._release(conn)
        elif isinstance(error, NodeUnavailable):
            self._fail(conn, error)
        else:
            conn.close()  # a caller's error mid-exchange: the socket's state is unknown

    def _fail(self, conn: NodeConnection | None, error: Exception) -> None:
        if conn is not None:
            conn.close()
        self.last_error = str(error)
        self._down_until = time.monotonic() + self.reconnect_s
        self.close()  # the other idle sockets to a failed node are as dead as this one


class _Loan:
    """`NodeLink.connection()`: a class, not a generator context manager, because every call pays for it."""

    __slots__ = ("_conn", "_link")

    def __init__(self, link: NodeLink) -> None:
        self._link = link

    def __enter__(self) -> NodeConnection:
        self._conn = self._link._acquire()
        return self._conn

    def __exit__(self, kind, error, tb) -> None:
        self._link._end_loan(self._conn, error)
