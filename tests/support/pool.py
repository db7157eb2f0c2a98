"""The pool tests' shared pieces: credentials, a raw protocol client, waiting on a condition."""

from __future__ import annotations

import os
import socket
import time

import pytest

from kvtier.pool import wire
from kvtier.pool.protocol import MsgType, encode
from kvtier.pool.tenants import proof
from kvtier.runtime import KVTier
from support.runtime import WAIT_S, blocks

SECRETS = {"alice": b"alice-secret-0123456789", "bob": b"bob-secret-9876543210"}


def store_each(kv: KVTier, keys) -> None:
    for k in keys:
        handle = kv.store([k], blocks([k]))
        assert handle.wait(WAIT_S) and not handle.failed, handle.failed
        kv.quiesce(WAIT_S)


class Raw:
    """A hand-driven connection: frames built and read one at a time, optionally authenticated."""

    def __init__(self, address: str, tenant: str = "default", secret: bytes = b"", *, auth: bool = True,
                 rcvbuf: int | None = None) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.socket()
        if rcvbuf:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.settimeout(30)
        self.sock.connect((host, int(port)))
        self.frames = wire.FrameSocket(self.sock)  # the node's and the client's own frame reader
        self.rid = 0
        if auth:
            nonce = os.urandom(32)
            hello = self.call(MsgType.HELLO, {"tenant": tenant, "nonce": nonce})
            self.call(MsgType.AUTH, {"mac": proof(secret, b"client", tenant, nonce, hello["nonce"])})

    def send(self, msg: int, header: dict, payload: bytes = b"") -> None:
        self.rid += 1
        self.sock.sendall(encode(msg, self.rid, header, len(payload)) + payload)

    def recv(self) -> tuple[MsgType, dict, int]:
        prefix, msg, header = self.frames.read_head(1 << 30, reply=True)
        return msg, header, prefix.payload_len

    def call(self, msg: int, header: dict, payload: bytes = b"") -> dict:
        self.send(msg, header, payload)
        got, header, _ = self.recv()
        assert got is msg, header
        return header

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


@pytest.fixture(scope="module")
def tenants_file(tmp_path_factory):
    """alice holds the operator's credential (node-wide STATS); bob is a tenant with a quota."""
    path = tmp_path_factory.mktemp("pool") / "tenants.yaml"
    (path.parent / "bob.key").write_bytes(SECRETS["bob"] + b"\n")
    path.write_text("tenants:\n"
                    f"  - {{name: alice, secret: {SECRETS['alice'].decode()}, operator: true}}\n"
                    "  - {name: bob, secret_file: bob.key, quota: 128KiB}\n")
    return path


def wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:
    """Polls `condition` (each try is a real call or read, never a sleep) until it holds; the
    deadline is a safety net for a loaded machine, never a measurement."""
    deadline = time.monotonic() + timeout_s
    while True:
        if condition():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"never: {what}")
