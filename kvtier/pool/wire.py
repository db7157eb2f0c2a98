"""Frames on a blocking socket: the only place the node and the client touch socket bytes.

Every function takes a `deadline` (a `time.monotonic()` value, or None for whatever timeout the
socket has) and raises `socket.timeout` once it passes, `ConnectionError` when the peer closes, and
`ProtocolError` on a bad frame (from `protocol`).

Deadlines are kept by the kernel: before each system call the time left goes into SO_RCVTIMEO or
SO_SNDTIMEO of a *blocking* socket. A Python socket timeout would turn every call into poll() plus a
non-blocking call, and a large block into many such rounds (a third of a 1 MiB put's time here).
"""

from __future__ import annotations

import errno
import socket
import struct
import time

from kvtier.pool.protocol import MAX_HEADER_BYTES, PREFIX_BYTES, MsgType, Prefix, parse_header, parse_prefix

_DRAIN_CHUNK = 1 << 16


def set_kernel_timeouts(sock: socket.socket, timeout_s: float) -> None:
    """Makes `sock` blocking, each receive and send ending after `timeout_s` (then `socket.timeout`)."""
    sock.settimeout(None)
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(timeout_s))


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, max(int((seconds - whole) * 1e6), 1 if not whole else 0))


def _arm(sock: socket.socket, deadline: float | None, opt: int = socket.SO_RCVTIMEO) -> None:
    if deadline is not None:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(left))


def _io(fn, *args):
    """Runs one socket call; a kernel timeout (EAGAIN on a blocking socket) becomes socket.timeout."""
    try:
        return fn(*args)
    except BlockingIOError as e:
        if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK):
            raise TimeoutError("timed out") from None
        raise


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fills all of `view` from the socket."""
    got, n = 0, len(view)
    while got < n:
        _arm(sock, deadline)
        k = _io(sock.recv_into, view[got:], n - got)
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytearray:
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return buf


def drain(sock: socket.socket, n: int, deadline: float | None = None) -> None:
    """Reads and drops `n` bytes (a refused WRITE's payload), keeping the stream in step."""
    scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
    while n > 0:
        k = min(n, len(scratch))
        recv_into(sock, scratch[:k], deadline)
        n -= k


def send(sock: socket.socket, head: bytes, payload: memoryview | None = None,
         deadline: float | None = None) -> None:
    """Sends a frame's prefix and header and its payload in one system call where it fits
    (`sendmsg` gathers both: no copy of the payload, no separate small packet for the header)."""
    _arm(sock, deadline, socket.SO_SNDTIMEO)
    if payload is None or not len(payload):
        _io(sock.sendall, head)
        return
    sent = _io(sock.sendmsg, [head, payload])
    if sent < len(head):
        _arm(sock, deadline, socket.SO_SNDTIMEO)
        _io(sock.sendall, head[sent:])
        sent = len(head)
    if sent - len(head) < len(payload):
        _arm(sock, deadline, socket.SO_SNDTIMEO)
        _io(sock.sendall, payload[sent - len(head):])


def read_head(sock: socket.socket, max_payload: int, *, reply: bool, deadline: float | None = None,
              max_header: int = MAX_HEADER_BYTES) -> tuple[Prefix, MsgType, dict]:
    """Reads one frame's prefix and header; the payload (`prefix.payload_len` bytes) stays unread.

    Raises:
        EOFError: the peer closed cleanly between frames.
        ConnectionError: the peer closed inside a frame.
        ProtocolError: a malformed, oversized or other-version frame.
    """
    prefix_buf = bytearray(PREFIX_BYTES)
    view = memoryview(prefix_buf)
    _arm(sock, deadline)
    first = _io(sock.recv_into, view, PREFIX_BYTES)
    if first == 0:
        raise EOFError("peer closed")
    recv_into(sock, view[first:], deadline)
    prefix = parse_prefix(prefix_buf, max_payload, max_header)
    body = recv_exact(sock, prefix.header_len, deadline)
    msg, header = parse_header(prefix, body, reply=reply)
    return prefix, msg, header


def linger_close(sock: socket.socket, timeout_s: float = 1.0, max_bytes: int = 1 << 20) -> None:
    """Closes after the peer has had the chance to read what was sent last (an error reply).

    Closing with unread input makes the kernel send a reset, which can destroy the error reply
    in flight; so shut down the sending side first and read a bounded amount until the peer closes.
    """
    try:
        sock.shutdown(socket.SHUT_WR)
        sock.settimeout(timeout_s)
        while max_bytes > 0:
            chunk = sock.recv(_DRAIN_CHUNK)
            if not chunk:
                break
            max_bytes -= len(chunk)
    except OSError:
        pass
    finally:
        sock.close()
