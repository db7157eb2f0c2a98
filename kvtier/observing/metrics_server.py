"""A bounded HTTP server for kvtier's Prometheus endpoints: one thread, a few connections, each with a deadline.

prometheus_client's `start_http_server` is a `ThreadingHTTPServer`: a thread per connection, no
idle timeout, no limit. Next to a pool node that is a side door: 300 idle connections took a node
from 4 to 304 threads and from 9 to 309 file descriptors, the same descriptor limit its data port
lives under. This server instead:

- runs one thread around a selector, whatever the number of connections;
- keeps at most `max_connections` open: one more closes the oldest, so a flood of idle
  connections cannot lock a scraper out for longer than it takes to send its request;
- gives each connection `timeout_s` from accept to the last byte of its answer, then closes it;
- answers one request per connection (`Connection: close`), with a request head of at most
  `MAX_REQUEST_BYTES`: GET or HEAD of `/metrics` (or `/`), in the format the `Accept` header asks
  for (prometheus_client's own encoders); anything else gets 400/404/405/431.

Nothing here imports torch; the pool node uses it.
"""

from __future__ import annotations

import logging
import selectors
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.exposition import choose_encoder

MAX_CONNECTIONS = 16
TIMEOUT_S = 10.0
MAX_REQUEST_BYTES = 8192
LISTEN_BACKLOG = 128  # queued in the kernel, not yet ours: no descriptor or thread of this process
_ACCEPTS_PER_ROUND = 256
_RECV_BYTES = 4096
_PATHS = ("/metrics", "/")

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Connection:
    sock: socket.socket
    deadline: float
    inbox: bytearray = field(default_factory=bytearray)
    outbox: memoryview | None = None  # the answer still to send, once the request is read


@dataclass(slots=True)
class MetricsServerStats:
    """What the server did: connections accepted, closed at their deadline, closed to make room
    for newer ones (`evicted`), requests answered, and requests refused as malformed."""

    accepted: int = 0
    timed_out: int = 0
    evicted: int = 0
    answered: int = 0
    bad_requests: int = 0


class MetricsServer:
    """Serves a prometheus_client registry on `addr:port` from one daemon thread; see the module docstring.

    Args:
        registry: what to expose (anything `generate_latest` takes).
        addr: the address to bind (127.0.0.1 unless an operator says otherwise).
        port: the port (0: any free port; `server_port` says which).
        max_connections: connections held at once.
        timeout_s: each connection's time from accept to the end of its answer.
    Raises:
        OSError: the address cannot be resolved or bound.
        ValueError: max_connections < 1 or timeout_s <= 0.
    """

    def __init__(self, registry: Any, addr: str = "127.0.0.1", port: int = 0,
                 max_connections: int = MAX_CONNECTIONS, timeout_s: float = TIMEOUT_S) -> None:
        if max_connections < 1 or not timeout_s > 0:
            raise ValueError(f"metrics server: max_connections >= 1 and timeout_s > 0, got {max_connections}, "
                             f"{timeout_s}")
        self._registry, self.max_connections, self.timeout_s = registry, max_connections, timeout_s
        self.stats = MetricsServerStats()
        self._listener = _bind(addr, port)
        self.server_address = self._listener.getsockname()
        self.server_port: int = self.server_address[1]
        self._connections: dict[socket.socket, _Connection] = {}  # in accept order: the first is the oldest
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._selector.register(self._listener, selectors.EVENT_READ, "listener")
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvtier-metrics-{self.server_port}", daemon=True)
        self._thread.start()

    @property
    def num_connections(self) -> int:
        """Connections open now (never more than `max_connections`)."""
        return len(self._connections)

    def shutdown(self) -> None:
        """Stops serving and closes every socket; idempotent. Returns once the thread has ended."""
        if not self._stopping:
            # Wake first, flag second: with the flag set first, the thread could see it on its own
            # wake-up, close every socket (this one too) and make the send fail with EBADF.
            try:
                self._wake_w.send(b"x")
            except OSError:  # the thread has ended and closed it already
                pass
            self._stopping = True
        self._thread.join()

    def server_close(self) -> None:
        """The same as `shutdown` (the name `socketserver` servers have)."""
        self.shutdown()

    # -- the serving thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                for key, mask in self._selector.select(self._wait_s()):
                    self._handle(key.data, mask)
                self._expire(time.monotonic())
        finally:
            self._close_all()

    def _handle(self, what: Any, mask: int) -> None:
        if what == "listener":
            self._accept()
        elif what == "wake":
            self._stopping = True
        elif mask & selectors.EVENT_READ and what.outbox is None:
            self._receive(what)
        elif mask & selectors.EVENT_WRITE:
            self._send(what)

    def _wait_s(self) -> float | None:
        """Until the nearest deadline (None: no connection, wait for the next event)."""
        if not self._connections:
            return None
        oldest = next(iter(self._connections.values()))  # accept order is deadline order
        return max(0.0, oldest.deadline - time.monotonic())

    def _accept(self) -> None:
        """Accepts what is waiting; past `max_connections` each new one closes the oldest."""
        for _ in range(_ACCEPTS_PER_ROUND):
            try:
                sock, _peer = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE and the like: the backlog waits until a descriptor frees
                log.warning("kvtier metrics: accept failed: %s", e)
                return
            if len(self._connections) >= self.max_connections:
                self.stats.evicted += 1
                self._close(next(iter(self._connections)))
            sock.setblocking(False)
            self._connections[sock] = _Connection(sock, time.monotonic() + self.timeout_s)
            self._selector.register(sock, selectors.EVENT_READ, self._connections[sock])
            self.stats.accepted += 1

    def _receive(self, conn: _Connection) -> None:
        try:
            data = conn.sock.recv(_RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn.sock)
            return
        conn.inbox += data
        end = conn.inbox.find(b"\r\n\r\n")
        if end < 0 and len(conn.inbox) > MAX_REQUEST_BYTES:
            self._answer(conn, _response(431, b"request head too large\n"))
        elif end >= 0:
            self._answer(conn, self._respond(bytes(conn.inbox[:end])))

    def _answer(self, conn: _Connection, response: bytes) -> None:
        conn.outbox = memoryview(response)
        self._selector.modify(conn.sock, selectors.EVENT_WRITE, conn)
        self._send(conn)

    def _send(self, conn: _Connection) -> None:
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn.sock)
            return
        conn.outbox = conn.outbox[sent:]
        if not conn.outbox:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._close(conn.sock)

    def _respond(self, head: bytes) -> bytes:
        """The whole HTTP answer to a request `head` (request line and headers, without the blank line)."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            self.stats.bad_requests += 1
            return _response(400, b"bad request\n")
        method, target = parts[0], parts[1]
        if method not in ("GET", "HEAD"):
            return _response(405, b"method not allowed\n", [("Allow", "GET, HEAD")])
        if target.split("?", 1)[0] not in _PATHS:
            return _response(404, b"not found: try /metrics\n")
        headers = dict(_header(line) for line in lines[1:] if ":" in line)
        try:
            encoder, content_type = choose_encoder(headers.get("accept", ""))
            body = encoder(self._registry)
        except Exception:  # a collector that failed: the scrape gets a 500, the server stays up
            log.exception("kvtier metrics: collecting failed")
            return _response(500, b"collecting metrics failed; see the server's log\n")
        self.stats.answered += 1
        return _response(200, body, [("Content-Type", content_type)], head_only=method == "HEAD")

    def _expire(self, now: float) -> None:
        """Closes connections past their deadline (oldest first, so it stops at the first one that is not)."""
        while self._connections:
            sock, conn = next(iter(self._connections.items()))
            if conn.deadline > now:
                return
            self.stats.timed_out += 1
            self._close(sock)

    def _close(self, sock: socket.socket) -> None:
        self._connections.pop(sock, None)
        try:
            self._selector.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()

    def _close_all(self) -> None:
        for sock in list(self._connections):
            self._close(sock)
        self._selector.close()
        for sock in (self._listener, self._wake_r, self._wake_w):
            sock.close()


def _bind(addr: str, port: int) -> socket.socket:
    """A non-blocking listening socket on `addr:port` (IPv4 or IPv6, as `addr` resolves)."""
    family, _, _, _, address = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _header(line: str) -> tuple[str, str]:
    name, value = line.split(":", 1)
    return name.strip().lower(), value.strip()


_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed",
            431: "Request Header Fields Too Large", 500: "Internal Server Error"}


def _response(status: int, body: bytes, headers: list[tuple[str, str]] | None = None,
              head_only: bool = False) -> bytes:
    """An HTTP/1.1 answer that closes the connection after it."""
    fields = list(headers or [])
    if not any(name == "Content-Type" for name, _ in fields):
        fields.append(("Content-Type", "text/plain; charset=utf-8"))
    fields += [("Content-Length", str(len(body))), ("Connection", "close")]
    head = f"HTTP/1.1 {status} {_REASONS[status]}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields) + "\r\n"
    return head.encode("latin-1") + (b"" if head_only else body)
