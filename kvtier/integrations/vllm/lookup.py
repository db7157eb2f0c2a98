"""Lookups and reports across processes for the vLLM connector.

Each worker rank holds its own slice of every block in its own process (under `vllm serve`, even
with one rank, the worker is another process than the scheduler), so the scheduler asks each rank
how many leading blocks it holds: `LookupServer` is the worker's end, on a Unix socket in a
directory private to the user; `RankLookup` the scheduler's. The same socket gives the rank's
metrics report (`fetch_report`), read when the scheduler's metrics endpoint is scraped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvtier.moving.cpus import pin_thread
from kvtier.integrations.vllm.backends import Backend
from kvtier.integrations.vllm.shards import Sharding
from kvtier.model.keys import KEY_BYTES, BlockKey

log = logging.getLogger(__name__)


# ---- lookups across processes ------------------------------------------------------------------
#
# One request: a u32 count n, then n engine-level keys of 16 bytes. One reply: a u32, how many
# leading keys the rank's backend holds (its own slices of those blocks). A count of _REPORT asks
# for the rank's report instead: a u32 length, then that many bytes of JSON. No pickle on the wire.

_COUNT = struct.Struct("<I")
_MAX_KEYS = 1 << 20
_REPORT = 0xFFFFFFFF
_MAX_REPORT_BYTES = 16 << 20
_RETRY_S = 1.0  # a rank that did not answer is not asked again for this long


def _recv_exact(conn: socket.socket, num_bytes: int) -> bytes:
    data = bytearray()
    while len(data) < num_bytes:
        chunk = conn.recv(num_bytes - len(data))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        data += chunk
    return bytes(data)


class LookupServer:
    """Answers the scheduler's lookups for one worker rank, on a Unix socket (see `RankLookup`).

    Args:
        path: the socket (`Settings.lookup_socket(rank)`); its directory must be private (0700,
            this user's), a stale socket left by a dead process is replaced.

        backend: the rank's backend.
        sharding: the rank's slice, which turns engine-level keys into the backend's.
        report: returns the rank's metrics report (JSON-ready); None: the rank reports nothing.
        cpus: the CPUs its threads run on (None: those of the thread that makes it).

    Raises:
        OSError: the socket cannot be made (the connector then runs without it).
    """

    def __init__(self, path: Path, backend: Backend, sharding: Sharding,
                 report: Callable[[], dict] | None = None, cpus: Sequence[int] | None = None) -> None:
        self.path, self.backend, self.sharding, self.report = path, backend, sharding, report
        self._cpus = cpus
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        owner = path.parent.stat()
        if owner.st_uid != os.getuid() or owner.st_mode & 0o077:
            raise PermissionError(f"{path.parent} is not private to this user")
        path.unlink(missing_ok=True)
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(8)
        self._conns: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name=f"kvtier-lookup-tp{sharding.rank}", daemon=True).start()

    def close(self) -> None:
        """Stops answering; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            conns, self._conns = self._conns, []
        for sock in (self._listener, *conns):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        pin_thread(self._cpus)  # the threads serving connections start from this one, and inherit it
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="kvtier-lookup-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                (n,) = _COUNT.unpack(_recv_exact(conn, _COUNT.size))
                if n == _REPORT:
                    data = self._report()
                    conn.sendall(_COUNT.pack(len(data)) + data)
                    continue
                if n > _MAX_KEYS:
                    return
                data = _recv_exact(conn, n * KEY_BYTES)
                keys = [BlockKey(data[i: i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]
                conn.sendall(_COUNT.pack(self._lookup(keys)))
        except (ConnectionError, OSError):
            return  # the scheduler went away or the server closed
        finally:
            conn.close()

    def _report(self) -> bytes:
        try:
            report = self.report() if self.report is not None else {}
        except Exception as e:  # a report that cannot be made is an empty one, said once per scrape
            log.warning("kvtier report of rank %d failed: %r", self.sharding.rank, e)
            report = {}
        return json.dumps(report, default=str).encode()

    def _lookup(self, keys: list[BlockKey]) -> int:
        try:
            return self.backend.loadable(self.sharding.keys(keys))
        except Exception as e:  # a broken backend holds nothing
            log.warning("kvtier lookup on rank %d failed, answering a miss: %r", self.sharding.rank, e)
            return 0


class RankLookup:
    """The scheduler's end of one rank's `LookupServer`.

    `lookup` returns None when the rank cannot be reached (no socket: a worker on another host, or
    not started) or does not answer within `timeout_s`; it is then not asked again for a second.
    """

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = path, timeout_s
        self._sock: socket.socket | None = None
        self._retry_at = 0.0

    def lookup(self, keys: Sequence[BlockKey]) -> int | None:
        if not keys:
            return 0
        sock = self._connect()
        if sock is None:
            return None
        try:
            sock.sendall(_COUNT.pack(len(keys)) + b"".join(keys))
            (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
            return min(n, len(keys))
        except (OSError, ConnectionError) as e:  # socket.timeout is an OSError
            log.warning("kvtier lookup socket %s did not answer, treating it as a miss: %r", self.path, e)
            self._drop()
            return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        if time.monotonic() < self._retry_at or not self.path.exists():
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout_s)
        try:
            sock.connect(str(self.path))
        except OSError:
            sock.close()
            self._drop()
            return None
        self._sock = sock
        return sock

    def _drop(self) -> None:
        self.close()
        self._retry_at = time.monotonic() + _RETRY_S


def fetch_report(path: Path, timeout_s: float) -> dict | None:
    """Rank `path`'s report (see `LookupServer`) over a connection of its own; None when the rank
    cannot be reached or does not answer within `timeout_s`."""
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    try:
        sock.connect(str(path))
        sock.sendall(_COUNT.pack(_REPORT))
        (n,) = _COUNT.unpack(_recv_exact(sock, _COUNT.size))
        if n > _MAX_REPORT_BYTES:
            return None
        return json.loads(_recv_exact(sock, n))
    except (OSError, ConnectionError, ValueError):
        return None
    finally:
        sock.close()
