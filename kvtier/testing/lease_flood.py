"""A lease flood against a pool node, for the attack test and the bench: GET frames that lease one
key 4,096 times each and never release, sent over several connections of one tenant, and the
node's resident memory read from /proc.
"""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass

from kvtier.pool import wire
from kvtier.pool.protocol import MAX_BATCH, ErrorCode, MsgType, encode
from kvtier.pool.tenants import proof
from kvtier.units import parse_address

FLOOD_KEY = b"flood-key"


@dataclass(frozen=True, slots=True)
class FloodCounts:
    """What one flood got back: frames sent, leased (answered with hits) and refused (LIMIT)."""

    num_frames: int
    num_leased: int
    num_refused: int


class RawConnection:
    """One authenticated connection driven a frame at a time (no pipelining, no retries)."""

    def __init__(self, address: str, tenant: str, secret: bytes, timeout_s: float = 60.0) -> None:
        host, port = parse_address(address, "lease flood: node address")
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.frames = wire.FrameSocket(self.sock)
        self._rid = 0
        nonce = os.urandom(32)
        _, hello = self.call(MsgType.HELLO, {"tenant": tenant, "nonce": nonce})
        self.call(MsgType.AUTH, {"mac": proof(secret, b"client", tenant, nonce, hello["nonce"])})

    def call(self, msg: MsgType, header: dict) -> tuple[MsgType, dict]:
        """Sends one frame and returns the reply's type and header (its payload is drained)."""
        self._rid += 1
        self.sock.sendall(encode(msg, self._rid, header))
        prefix, got, reply = self.frames.read_head(1 << 30, reply=True)
        self.frames.drain(prefix.payload_len)
        return got, reply

    def close(self) -> None:
        self.sock.close()


def flood_header(lease_s: float) -> dict:
    """A GET that leases `FLOOD_KEY` MAX_BATCH times (not inline: every hit is leased)."""
    return {"keys": [FLOOD_KEY] * MAX_BATCH, "lease_s": lease_s, "release": [], "inline": False}


class LeaseFlood:
    """`num_connections` connections of one tenant, each sending `frames_per_connection` GETs one
    after another from its own thread (`run`); the connections stay open, and their leases with
    them, until `close`. The tenant must hold `FLOOD_KEY` already."""

    def __init__(self, address: str, tenant: str, secret: bytes, num_connections: int,
                 frames_per_connection: int, lease_s: float = 60.0) -> None:
        self.frames_per_connection, self.lease_s = frames_per_connection, lease_s
        self.conns = [RawConnection(address, tenant, secret) for _ in range(num_connections)]

    def run(self) -> FloodCounts:
        """Sends every frame; returns what came back.

        Raises:
            AssertionError: a reply was neither the GET's (all hits) nor a LIMIT error.
        """
        results: list[list[bool]] = [[] for _ in self.conns]
        errors: list[BaseException] = []
        threads = [threading.Thread(target=self._send_all, args=(conn, out, errors), daemon=True)
                   for conn, out in zip(self.conns, results)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        leased, frames = sum(map(sum, results)), sum(map(len, results))
        return FloodCounts(frames, leased, frames - leased)

    def _send_all(self, conn: RawConnection, out: list[bool], errors: list[BaseException]) -> None:
        try:
            for _ in range(self.frames_per_connection):
                msg, reply = conn.call(MsgType.GET, flood_header(self.lease_s))
                if msg is MsgType.ERROR and reply["code"] == ErrorCode.LIMIT:
                    out.append(False)
                elif msg is MsgType.GET and all(hit[0] for hit in reply["hits"]):
                    out.append(True)
                else:
                    raise AssertionError(f"flood frame answered {msg.name}: {reply}")
        except BaseException as e:  # handed to `run`'s caller
            errors.append(e)

    def close(self) -> None:
        for conn in self.conns:
            conn.close()


def rss_bytes(pid: int) -> int:
    """The resident set size of process `pid` (VmRSS in /proc/<pid>/status)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")
