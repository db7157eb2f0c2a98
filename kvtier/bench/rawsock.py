"""The raw TCP socket limit: the least any protocol can cost to move a block to another process.

`python -m kvtier.bench.rawsock` serves on 127.0.0.1 (one thread per connection), printing its port:
  "P" + u64 n + n bytes  ->  1-byte ack            (what a one-sided write costs at the least)
  "G" + u64 n            ->  n bytes               (what a one-sided read costs at the least)
It runs in its own process, as a pool node does, so neither side shares the bench's interpreter.
Nothing here imports torch.
"""

from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading

_HEAD = struct.Struct("!cQ")


def recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Receives exactly `len(view)` bytes. Raises ConnectionError if the peer closes first."""
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def _serve_connection(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(0))
    head = memoryview(bytearray(_HEAD.size))
    with conn:
        try:
            while True:
                recv_exactly(conn, head)
                op, n = _HEAD.unpack(head)
                if len(buf) < n:
                    buf = memoryview(bytearray(n))
                if op == b"P":
                    recv_exactly(conn, buf[:n])
                    conn.sendall(b"k")
                else:
                    conn.sendall(buf[:n])
        except (ConnectionError, OSError):
            return


def serve() -> None:
    """Accepts connections until stdin closes (the parent went away) or the process is killed."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    # Closing the socket would not wake `accept`: the process ends once its parent closes our stdin.
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    print(srv.getsockname()[1], flush=True)
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()


class RawSocketServer:
    """The server subprocess; `connect()` opens one client connection per caller thread."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "kvtier.bench.rawsock"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line.strip().isdigit():
            self.close()
            raise RuntimeError(f"raw socket server did not start (said {line!r})")
        self.port = int(line)

    def connect(self) -> RawSocketClient:
        return RawSocketClient(("127.0.0.1", self.port))

    def close(self) -> None:
        """Closes its stdin (it exits), then waits; kills it if it lingers."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()


class RawSocketClient:
    """One TCP connection to a `RawSocketServer`; not thread-safe (one per thread)."""

    def __init__(self, address: tuple[str, int]) -> None:
        self.sock = socket.create_connection(address)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._ack = memoryview(bytearray(1))

    def put(self, data: memoryview) -> None:
        """Sends the bytes and waits for the server's ack."""
        head = _HEAD.pack(b"P", len(data))
        sent = self.sock.sendmsg([head, data])  # one segment train, as a real protocol's header + payload
        if sent < len(head):
            self.sock.sendall(head[sent:])
            sent = len(head)
        if sent - len(head) < len(data):
            self.sock.sendall(data[sent - len(head):])
        recv_exactly(self.sock, self._ack)

    def get(self, into: memoryview) -> None:
        """Asks for `len(into)` bytes and receives them into `into`."""
        self.sock.sendall(_HEAD.pack(b"G", len(into)))
        recv_exactly(self.sock, into)

    def close(self) -> None:
        self.sock.close()


if __name__ == "__main__":
    serve()
