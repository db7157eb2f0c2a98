"""A pool node's front door: the accept loop, the bounds on connections and handshakes, the
challenge-response handshake itself, and the throttle on failed authentications.

What it defends against, and how:
- **Connections over the limit** are told BUSY and closed from the accept loop itself, without a
  thread: the reply is sent non-blocking (it fits any fresh socket's send buffer), the sending
  side shut, and the socket kept in the loop's selector until the peer closes or `LINGER_S`
  passes (closing with unread input would reset the connection and could destroy the reply).
  At most `MAX_LINGERING` such sockets are kept; past that the oldest is closed at once.
- **Slow handshakes** (slowloris: sockets that send a byte now and then and never authenticate)
  have one deadline for the whole handshake, not one per receive, and at most `max_handshakes` of
  them are pending at once: a new connection then closes the oldest pending one, and so does one
  that finds the node full while handshakes are pending. A real client finishes its handshake in
  about a millisecond, an attacker never does, so the attacker's sockets are the ones that go.
  Authenticated connections are never closed to make room.
- **Guessed secrets**: `AuthThrottle` counts failed authentications per peer address; past a few, a
  peer's new connections are refused at accept for a backoff that doubles with each failure.

Counters (`Admission.counters`, node-wide, the operator's): connections, refused_busy,
handshakes_evicted, handshake_timeouts, auth_failures, auth_throttled.
"""

from __future__ import annotations

import hmac
import logging
import os
import selectors
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.pool import wire
from kvtier.pool.protocol import MAX_HANDSHAKE_HEADER_BYTES, REPLY, ErrorCode, MsgType, ProtocolError, encode_error
from kvtier.pool.tenants import Tenant, proof

log = logging.getLogger(__name__)
LINGER_S = 1.0  # how long a refused socket may take to read its BUSY before it is closed
MAX_LINGERING = 256
_ACCEPTS_PER_WAKE = 64  # then the loop serves its other sockets before accepting more
_NO_SECRET = os.urandom(32)  # what an unknown tenant's proof is checked against: same work, never a match


class AuthThrottle:
    """Failed authentications per peer and the backoff they earn. Sans-I/O: the clock is passed in.

    The first `free_failures` failures of a peer cost nothing (typos happen); each further one
    blocks the peer for `backoff_s`, doubled per failure, at most `max_backoff_s`. A peer with no
    failure for `2 * max_backoff_s` is forgotten. Success does not reset the count: an attacker
    holding one tenant's secret must not be able to wash away its guesses at another's.
    At most `max_peers` peers are tracked (least recently failed dropped first), so a flood of
    addresses bounds memory (and only forgets its own oldest entries).

    Args:
        clock: seconds, monotonic.
    """

    def __init__(self, clock: Callable[[], float], *, free_failures: int = 5, backoff_s: float = 1.0,
                 max_backoff_s: float = 60.0, max_peers: int = 4096) -> None:
        self._clock = clock
        self.free_failures, self.backoff_s, self.max_backoff_s = free_failures, backoff_s, max_backoff_s
        self.max_peers = max_peers
        self._peers: OrderedDict[str, tuple[int, float, float]] = OrderedDict()  # failures, blocked until, last

    def __len__(self) -> int:
        return len(self._peers)

    def retry_in(self, peer: str) -> float:
        """Seconds until `peer` may try again; 0.0 when it may now."""
        entry = self._peers.get(peer)
        if entry is None:
            return 0.0
        now = self._clock()
        if now - entry[2] > 2 * self.max_backoff_s:
            del self._peers[peer]
            return 0.0
        return max(entry[1] - now, 0.0)

    def failed(self, peer: str) -> None:
        """Records one failed authentication of `peer`."""
        self.retry_in(peer)  # forgets a peer quiet for long enough
        now = self._clock()
        failures = self._peers.pop(peer, (0, 0.0, now))[0] + 1
        over = failures - self.free_failures
        until = now + min(self.backoff_s * 2 ** (over - 1), self.max_backoff_s) if over > 0 else 0.0
        self._peers[peer] = (failures, until, now)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)


@dataclass(frozen=True, slots=True)
class Limits:
    """The bounds `Admission` keeps; see the module docstring."""

    max_connections: int = 1024  # authenticated and pending together
    max_handshakes: int = 64  # pending at once
    handshake_timeout_s: float = 10.0  # for the whole handshake


class Admission:
    """Accepts connections on `listener` and hands each admitted one to `on_accept(sock, peer,
    deadline)` (which starts its thread); that thread runs `handshake`, and `closed` when it
    ends. `run` is the accept loop's body; `stop` ends it.

    Args:
        tenants: name -> credentials.
        welcome: what the AUTH reply tells a client besides the node's proof (node id, transport...).
        throttle: failed authentications per peer address.
    """

    def __init__(self, listener: socket.socket, limits: Limits, tenants: dict[str, Tenant], welcome: dict[str, Any],
                 throttle: AuthThrottle, on_accept: Callable[[socket.socket, Any, float], None]) -> None:
        self._listener, self.limits, self._tenants, self._welcome = listener, limits, tenants, welcome
        self.throttle, self._on_accept = throttle, on_accept
        self._lock = threading.Lock()  # pending, authenticated, counters and the throttle
        self._pending: OrderedDict[socket.socket, None] = OrderedDict()  # oldest first
        self._authenticated: set[socket.socket] = set()
        self._lingering: OrderedDict[socket.socket, float] = OrderedDict()  # refused: closing deadline
        self._wake_r, self._wake_w = os.pipe()
        self.counters = dict.fromkeys(("connections", "refused_busy", "handshakes_evicted", "handshake_timeouts",
                                       "auth_failures", "auth_throttled"), 0)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    # ---- the accept loop (one thread) -----------------------------------------------------------

    def run(self) -> None:
        """Accepts until `stop`; closes the listener and every lingering socket on the way out."""
        self._listener.setblocking(False)
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            try:
                while True:
                    ready = sel.select(self._next_linger_timeout())
                    if any(key.fileobj == self._wake_r for key, _ in ready):
                        break
                    for key, _ in ready:
                        if key.fileobj is self._listener:
                            self._accept_some(sel)
                        else:
                            self._drain(sel, key.fileobj)
                    self._close_lingering(sel, time.monotonic())
            finally:
                self._close_lingering(sel, float("inf"))
                self._listener.close()

    def stop(self) -> None:
        """Wakes the accept loop, which then exits (and closes the listener)."""
        os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Releases the wake-up pipe; after `stop`, once the loop has exited."""
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _accept_some(self, sel: selectors.BaseSelector) -> None:
        for _ in range(_ACCEPTS_PER_WAKE):
            try:
                sock, peer = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:  # out of descriptors, most likely: free the oldest pending one
                log.warning("pool node: accept failed: %s", e)
                with self._lock:
                    self._evict_oldest()
                return
            self._admit(sel, sock, peer)

    def _admit(self, sel: selectors.BaseSelector, sock: socket.socket, peer: Any) -> None:
        sock.setblocking(True)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self._lock:
            wait_s = self.throttle.retry_in(peer[0])
            if wait_s:
                self.counters["auth_throttled"] += 1
                refusal = (ErrorCode.BUSY, f"too many failed authentications from {peer[0]}; retry in {wait_s:.0f} s")
            elif len(self._authenticated) >= self.limits.max_connections:
                self.counters["refused_busy"] += 1
                refusal = (ErrorCode.BUSY, "node at its connection limit")
            else:
                refusal = None
                full = len(self._authenticated) + len(self._pending) >= self.limits.max_connections
                if full or len(self._pending) >= self.limits.max_handshakes:
                    self._evict_oldest()
                self._pending[sock] = None
                self.counters["connections"] += 1
        if refusal is not None:
            return self._refuse(sel, sock, *refusal)
        try:
            self._on_accept(sock, peer, time.monotonic() + self.limits.handshake_timeout_s)
        except RuntimeError as e:  # no thread to be had: this connection goes, the loop goes on
            log.warning("pool node: cannot serve a connection: %s", e)
            self.closed(sock)
            sock.close()

    def _evict_oldest(self) -> None:
        """Closes the oldest pending handshake (its thread sees the end of stream and exits). Lock held."""
        if self._pending:
            oldest, _ = self._pending.popitem(last=False)
            self.counters["handshakes_evicted"] += 1
            try:
                oldest.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _refuse(self, sel: selectors.BaseSelector, sock: socket.socket, code: ErrorCode, message: str) -> None:
        """Tells `sock` why, without blocking, and lingers on it in the selector (no thread)."""
        try:
            sock.setblocking(False)
            sock.send(encode_error(0, code, message))
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            sock.close()
            return
        if len(self._lingering) >= MAX_LINGERING:
            old, _ = self._lingering.popitem(last=False)
            sel.unregister(old)
            old.close()
        self._lingering[sock] = time.monotonic() + LINGER_S
        sel.register(sock, selectors.EVENT_READ)

    def _drain(self, sel: selectors.BaseSelector, sock: socket.socket) -> None:
        """Reads what a refused peer sent; closes once it closed too."""
        try:
            if sock.recv(1 << 16):
                return
        except BlockingIOError:
            return
        except OSError:
            pass
        del self._lingering[sock]
        sel.unregister(sock)
        sock.close()

    def _close_lingering(self, sel: selectors.BaseSelector, now: float) -> None:
        while self._lingering:
            sock, deadline = next(iter(self._lingering.items()))
            if deadline > now:
                return
            del self._lingering[sock]
            sel.unregister(sock)
            sock.close()

    def _next_linger_timeout(self) -> float | None:
        if not self._lingering:
            return None
        return max(next(iter(self._lingering.values())) - time.monotonic(), 0.0)

    # ---- each connection's thread -----------------------------------------------------------

    def handshake(self, frames: wire.FrameSocket, sock: socket.socket, peer: Any, deadline: float) -> Tenant:
        """HELLO and AUTH, both before `deadline`; returns the authenticated tenant.

        `sock` (under `frames`) moves from pending to authenticated *before* the AUTH reply goes
        out: a client that has its reply holds a counted slot, so a connection it opens next can
        neither evict it nor squeeze past the limit beside it.

        Raises:
            ProtocolError: AUTH (not HELLO first, an unknown tenant or a wrong proof; counted, and
                held against the peer's address), or as `FrameSocket.read_head`.
            TimeoutError: the deadline passed (counted).
            EOFError, OSError: the peer went away, or this handshake was evicted.
        """
        try:
            return self._challenge(frames, sock, peer, deadline)
        except TimeoutError:
            with self._lock:
                self.counters["handshake_timeouts"] += 1
            raise

    def _challenge(self, frames: wire.FrameSocket, sock: socket.socket, peer: Any, deadline: float) -> Tenant:
        read = lambda: frames.read_head(0, reply=False, deadline=deadline, max_header=MAX_HANDSHAKE_HEADER_BYTES)
        prefix, msg, hello = read()
        if msg is not MsgType.HELLO:
            raise ProtocolError(ErrorCode.AUTH, f"expected HELLO first, got {msg.name}", prefix.request_id)
        nonce, node = os.urandom(32), self._welcome["node"]
        frames.send(REPLY | MsgType.HELLO, prefix.request_id, {"nonce": nonce, "node": node}, deadline=deadline)
        prefix, msg, auth = read()
        name = hello["tenant"]
        tenant = self._tenants.get(name)
        expected = proof(tenant.secret if tenant else _NO_SECRET, b"client", name, hello["nonce"], nonce)
        if msg is not MsgType.AUTH or tenant is None or not hmac.compare_digest(expected, auth["mac"]):
            with self._lock:
                self.counters["auth_failures"] += 1
                self.throttle.failed(peer[0])
            raise ProtocolError(ErrorCode.AUTH, "authentication failed (unknown tenant or wrong secret)",
                                prefix.request_id)
        if not self._authenticate(sock):
            raise EOFError("handshake evicted as it finished")  # the socket is shut already
        frames.send(REPLY | MsgType.AUTH, prefix.request_id, {
            "mac": proof(tenant.secret, b"node", name, hello["nonce"], nonce), **self._welcome}, deadline=deadline)
        return tenant

    def _authenticate(self, sock: socket.socket) -> bool:
        """Moves `sock` from pending to authenticated; False when it was evicted meanwhile."""
        with self._lock:
            if sock not in self._pending:
                return False
            del self._pending[sock]
            self._authenticated.add(sock)
            return True

    def closed(self, sock: socket.socket) -> None:
        """Forgets a connection that ended, pending or authenticated (before its socket is closed,
        so it cannot be evicted after)."""
        with self._lock:
            self._authenticated.discard(sock)
            self._pending.pop(sock, None)
