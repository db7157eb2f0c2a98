"""Frames on a blocking socket: the only place the node and the client touch socket bytes.

`FrameSocket` wraps one connection's socket. Every method takes a `deadline` (a `time.monotonic()`
value, or None for whatever timeout the socket has) and raises `socket.timeout` once it passes,
`ConnectionError` when the peer closes, and `ProtocolError` on a bad frame (from `protocol`).

Where the time of a small exchange goes, and what this module does about it (measured at 64 KiB,
where a raw socket's round trip is ~25 µs and each Python-level system call ~1-2 µs):
- Reads go through a small buffer: one `recv` brings a frame's prefix, its header and the first
  payload bytes (copied out, at most `RECV_BUFFER_BYTES`); the rest of a payload goes straight into
  its destination (the node's arena, the caller's buffer) with `recv_into`. Before, the prefix and
  the header took a system call each.
- Deadlines are kept by the kernel: the time left goes into SO_RCVTIMEO / SO_SNDTIMEO of a
  *blocking* socket. A Python socket timeout would turn every call into poll() plus a non-blocking
  call, and a large block into many such rounds. The option is set again only when the time left
  has drifted from the armed value by more than `ARM_SLACK_S`, so an exchange of microseconds costs
  no `setsockopt` at all and a call ends at most that late.
- A frame goes out in one `sendmsg` (prefix and header gathered with the payload's buffers: no copy,
  no separate small packet), packed by this connection's own msgpack `Packer`; a client's pipelined
  batch goes out in one `sendmsg` too (`frame` + `send_buffers`).
"""

from __future__ import annotations

import errno
import math
import os
import socket
import struct
import time
from collections.abc import Sequence
from typing import Any

import msgpack

from kvtier.moving import _movers
from kvtier.pool.protocol import (
    MAX_HEADER_BYTES,
    PREFIX_BYTES,
    MsgType,
    Prefix,
    encode,
    parse_header,
    parse_prefix,
)

RECV_BUFFER_BYTES = 4096  # holds any usual prefix + header; larger headers get a buffer of their own
ARM_SLACK_S = 1e-3
_DRAIN_CHUNK = 1 << 16
_IOV_MAX = 512  # buffers per sendmsg, below Linux's IOV_MAX of 1024
_TIMEOUT_OPTS = (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO)


def _timeval(seconds: float) -> bytes:
    whole = int(seconds)
    return struct.pack("ll", whole, max(int((seconds - whole) * 1e6), 1 if not whole else 0))


def _timed_out(e: BlockingIOError) -> OSError:
    """What a socket call that failed with `e` raises: a kernel timeout (EAGAIN on a blocking
    socket) becomes socket.timeout; anything else stays itself."""
    return TimeoutError("timed out") if e.errno in (errno.EAGAIN, errno.EWOULDBLOCK) else e


class FrameSocket:
    """One connection's socket, read and written frame by frame. Not thread-safe: one user at a time.

    Args:
        sock: a connected stream socket; this object does not close it.
        timeout_s: made the socket's kernel timeout for each receive and send (see `set_timeout`);
            None leaves the socket's timeout as it is.
    """

    def __init__(self, sock: socket.socket, timeout_s: float | None = None) -> None:
        self.sock = sock
        self._buf = bytearray(RECV_BUFFER_BYTES)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # buffered, unread bytes: _buf[_start:_end]
        self._armed: list[float | None] = [None, None]  # kernel timeout set now: receive, send
        self._pack = msgpack.Packer(use_bin_type=True, buf_size=RECV_BUFFER_BYTES).pack  # grows when needed
        if timeout_s is not None:
            self.set_timeout(timeout_s)

    @property
    def buffered(self) -> int:
        """Bytes received but not yet read as part of a frame."""
        return self._end - self._start

    def set_timeout(self, timeout_s: float) -> None:
        """Makes the socket blocking, each receive and send ending after `timeout_s` (then `socket.timeout`)."""
        self.sock.settimeout(None)
        for i, opt in enumerate(_TIMEOUT_OPTS):
            self.sock.setsockopt(socket.SOL_SOCKET, opt, _timeval(timeout_s))
            self._armed[i] = timeout_s

    # ---- receiving ----------------------------------------------------------------------------

    def read_head(self, max_payload: int, *, reply: bool, deadline: float | None = None,
                  max_header: int = MAX_HEADER_BYTES) -> tuple[Prefix, MsgType, dict]:
        """Reads one frame's prefix and header; its payload (`prefix.payload_len` bytes) is read next
        with `recv_into` or `drain`.

        Raises:
            EOFError: the peer closed cleanly between frames.
            ConnectionError: the peer closed inside a frame.
            ProtocolError: a malformed, oversized or other-version frame.
        """
        if self._start == self._end:
            self._start = self._end = 0
        self._fill(PREFIX_BYTES, deadline, between_frames=True)
        at = self._start
        prefix = parse_prefix(self._view[at: at + PREFIX_BYTES], max_payload, max_header)
        self._start = at + PREFIX_BYTES
        msg, header = parse_header(prefix, self._take(prefix.header_len, deadline), reply=reply)
        return prefix, msg, header

    def recv_into(self, view: memoryview, deadline: float | None = None, sums: Any = None) -> None:
        """Fills all of `view`: first from the buffered bytes, then straight from the socket.

        `sums`: a `kvtier.tiers.base.LayerSums` whose layers (offsets into `view`) are hashed as
        they come in, in one native call outside the GIL; its `done` is set once all are."""
        n = len(view)
        got = min(n, self._end - self._start)
        if got:
            view[:got] = self._view[self._start: self._start + got]
            self._start += got
        if sums is not None:
            self._recv_summed(view, got, sums, deadline)
            return
        while got < n:
            self._arm(0, deadline)
            try:
                k = self.sock.recv_into(view[got:], n - got)
            except BlockingIOError as e:
                raise _timed_out(e) from None
            if k == 0:
                raise ConnectionError(f"peer closed after {got} of {n} bytes")
            got += k

    def _recv_summed(self, view: memoryview, got: int, sums: Any, deadline: float | None) -> None:
        at = time.monotonic() + self._armed[0] if deadline is None and self._armed[0] else deadline
        got, error = _movers.recv_layers(self.sock.fileno(), view, got, sums.rel, sums.lengths, sums.seed, sums.layer0,
                                         sums.out, math.inf if at is None else at)
        if error == -1:
            raise ConnectionError(f"peer closed after {got} of {len(view)} bytes")
        if error == errno.ETIMEDOUT:
            raise TimeoutError(f"timed out after {got} of {len(view)} bytes")
        if error:
            raise OSError(error, os.strerror(error))
        sums.done = True

    def drain(self, n: int, deadline: float | None = None) -> None:
        """Reads and drops `n` bytes (a refused payload), keeping the stream in step."""
        skip = min(n, self._end - self._start)
        self._start += skip
        n -= skip
        if n:
            scratch = memoryview(bytearray(min(n, _DRAIN_CHUNK)))
            while n > 0:
                k = min(n, len(scratch))
                self.recv_into(scratch[:k], deadline)
                n -= k

    def _fill(self, n: int, deadline: float | None, between_frames: bool = False) -> None:
        """Makes at least `n` (<= RECV_BUFFER_BYTES) bytes buffered at `_start`."""
        if self._end - self._start >= n:
            return
        if self._start + n > len(self._buf):  # move the unread tail to the front
            left = self._end - self._start
            self._view[:left] = self._view[self._start: self._end]
            self._start, self._end = 0, left
        while self._end - self._start < n:
            self._arm(0, deadline)
            try:
                k = self.sock.recv_into(self._view[self._end:], len(self._buf) - self._end)
            except BlockingIOError as e:
                raise _timed_out(e) from None
            if k == 0:
                if between_frames and self._end == self._start:
                    raise EOFError("peer closed")
                raise ConnectionError(f"peer closed inside a frame ({self._end - self._start} of {n} bytes)")
            self._end += k

    def _take(self, n: int, deadline: float | None) -> memoryview | bytearray:
        """The next `n` bytes: a view of the buffer (valid until the next read) or, when they do
        not fit it, a buffer of their own."""
        if n <= len(self._buf):
            self._fill(n, deadline)
            at = self._start
            self._start = at + n
            return self._view[at: at + n]
        out = bytearray(n)
        self.recv_into(memoryview(out), deadline)
        return out

    # ---- sending ------------------------------------------------------------------------------

    def send(self, msg: int, request_id: int, header: dict[str, Any] | bytes,
             payloads: Sequence[memoryview] = (), deadline: float | None = None) -> None:
        """Sends one frame whose payload is `payloads`, one after another (`header`: its fields,
        or their msgpack already made, as `protocol.encode` takes it)."""
        self.send_buffers(self.frame(msg, request_id, header, payloads), deadline)

    def frame(self, msg: int, request_id: int, header: dict[str, Any] | bytes,
              payloads: Sequence[memoryview] = ()) -> list:
        """The buffers of one frame, to send with `send_buffers` (several frames' in one call)."""
        if not payloads:
            return [encode(msg, request_id, header, 0, pack=self._pack)]
        return [encode(msg, request_id, header, sum(map(len, payloads)), pack=self._pack), *payloads]

    def send_buffers(self, buffers: list, deadline: float | None = None) -> None:
        """Sends `buffers` in order, gathered into as few `sendmsg` calls as the kernel allows."""
        while buffers:
            batch = buffers[:_IOV_MAX]
            self._arm(1, deadline)
            try:
                sent = self.sock.sendmsg(batch)
            except BlockingIOError as e:
                raise _timed_out(e) from None
            for i, buf in enumerate(batch):
                if sent < len(buf):
                    buffers = [memoryview(buf)[sent:], *buffers[i + 1:]]
                    break
                sent -= len(buf)
            else:
                buffers = buffers[len(batch):]

    # ---- deadlines ----------------------------------------------------------------------------

    def _arm(self, which: int, deadline: float | None) -> None:
        """Sets the kernel timeout of receives (0) or sends (1) to the time left, unless already close."""
        if deadline is None:
            return
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("deadline passed")
        armed = self._armed[which]
        if armed is None or abs(armed - left) > ARM_SLACK_S:
            self.sock.setsockopt(socket.SOL_SOCKET, _TIMEOUT_OPTS[which], _timeval(left))
            self._armed[which] = left


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
