"""Attacks on a pool node's front door, with real `kvtier pool serve` subprocesses and real sockets
on 127.0.0.1: slowloris sockets that never authenticate, a flood of connections over the limit, a
handshake trickled byte by byte, and guessed secrets. What must hold: a real client is still
served, the node's threads stay bounded, and every refusal is counted. Nothing waits on a timer:
conditions are polled (node threads from /proc, counters from STATS). Cost: about 6 s (four node
starts, 700 sockets).
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from kvtier.pool import wire
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.connection import AuthFailed
from kvtier.pool.protocol import PREFIX, VERSION, ErrorCode, MsgType
from kvtier.pool.tenants import proof
from kvtier.pool.node.process import NodeProcess, running_node
from support.pool import SECRETS, WAIT_S, Raw


def node_threads(node: NodeProcess) -> int:
    """The node process's thread count, as the kernel has it."""
    status = Path(f"/proc/{node.proc.pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


from support.pool import wait_until




def connect(address: str, source: str | None = None) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.socket()
    if source is not None:
        sock.bind((source, 0))
    sock.settimeout(WAIT_S)
    sock.connect((host, int(port)))
    return sock


def authenticate(address: str, tenant: str = "default", secret: bytes = b"",
                 source: str | None = None) -> tuple[Raw, ErrorCode | None]:
    """A raw connection through HELLO and AUTH; the error code the node answered with, if any."""
    raw = Raw(address, auth=False)
    if source is not None:  # Raw connects to the node itself; this one comes from another address
        raw.sock.close()
        raw.sock = connect(address, source)
        raw.frames = wire.FrameSocket(raw.sock)
    nonce = os.urandom(32)
    raw.send(MsgType.HELLO, {"tenant": tenant, "nonce": nonce})
    msg, header, _ = raw.recv()
    if msg is MsgType.ERROR:
        return raw, ErrorCode(header["code"])
    raw.send(MsgType.AUTH, {"mac": proof(secret, b"client", tenant, nonce, header["nonce"])})
    msg, reply, _ = raw.recv()
    return raw, ErrorCode(reply["code"]) if msg is MsgType.ERROR else None


def test_slowloris_sockets_never_lock_a_real_client_out_nor_hold_a_thread_each():
    """500 sockets that send one byte and never authenticate, against a node of 50 connections of
    which 16 may be handshaking: each new one closes the oldest pending, so a real client (whose
    handshake takes a millisecond) gets in, and the node's threads stay near 16."""
    with running_node(capacity="4MiB", extra=["--max-connections", "50", "--max-handshakes", "16"]) as node:
        attackers = []
        try:
            for _ in range(500):
                attackers.append(connect(node.address))
                attackers[-1].send(b"K")  # the first byte of a frame, and never the rest
            with PoolClient([node.address], timeout_s=WAIT_S, reconnect_s=0) as c:
                assert c.put(b"k", b"v" * 1000), "a real client is served"
                assert c.get(b"k", bytearray(1000))
                wait_until(lambda: c.stats()[0]["handshakes_evicted"] >= 500 - 16, "the attackers' sockets closed")
                wait_until(lambda: node_threads(node) <= 16 + 8, "the evicted handshakes' threads gone")
                facts = c.stats()[0]
            assert facts["handshakes_pending"] <= 16 and facts["refused_busy"] == 0
        finally:
            for sock in attackers:
                sock.close()


def test_connections_over_the_limit_are_refused_at_once_without_a_thread_each():
    with running_node(capacity="4MiB", extra=["--max-connections", "4"]) as node:
        held: list[Raw] = []

        def fill() -> bool:  # the readiness probe's socket may still count for a moment
            raw, error = authenticate(node.address)
            (held.append(raw) if error is None else raw.close())
            return len(held) == 4

        wait_until(fill, "four authenticated connections")
        refused = [connect(node.address) for _ in range(200)]
        try:
            stats = lambda: held[0].call(MsgType.STATS, {})["stats"]
            wait_until(lambda: stats()["refused_busy"] >= 200, "200 refusals")
            assert node_threads(node) <= 4 + 4, "no thread per refused socket"
            for sock in refused[:3]:
                frames = wire.FrameSocket(sock)
                _, msg, header = frames.read_head(0, reply=True)
                assert msg is MsgType.ERROR and header["code"] == ErrorCode.BUSY
            assert stats()["active_connections"] == 4
        finally:
            for sock in refused:
                sock.close()
            for raw in held:
                raw.close()


def test_a_handshake_trickled_byte_by_byte_is_cut_off_at_its_deadline():
    """The deadline is on the whole handshake: a byte every 0.1 s keeps no receive waiting for
    0.5 s, yet the connection is closed once 0.5 s have passed since it was accepted."""
    with running_node(capacity="4MiB", extra=["--handshake-timeout-s", "0.5"]) as node:
        sock = connect(node.address)
        sock.sendall(PREFIX.pack(b"KT", VERSION, MsgType.HELLO, 1, 1000, 0))  # a header of 1000 bytes follows
        sock.settimeout(0.1)  # how long each round waits for the node to close, not a measurement
        sent = 0
        while sent < 50:
            try:
                if sock.recv(1) == b"":
                    break
            except TimeoutError:
                sock.send(b"\x00")
                sent += 1
            except ConnectionResetError:
                break
        sock.close()
        assert sent < 50, "closed while still trickling"
        with PoolClient([node.address], timeout_s=WAIT_S) as c:
            assert c.stats()[0]["handshake_timeouts"] == 1


def test_guessing_secrets_gets_an_address_refused_at_accept_while_others_are_served(tenants_file):
    with running_node(capacity="4MiB", tenants=tenants_file, credentials=("alice", SECRETS["alice"])) as node:
        codes = []
        for _ in range(30):  # 127.0.0.2 guesses alice's secret
            raw, error = authenticate(node.address, "alice", b"guess-%d" % len(codes), source="127.0.0.2")
            raw.close()
            codes.append(error)
            if error is ErrorCode.BUSY:
                break
        assert codes[:5] == [ErrorCode.AUTH] * 5 and codes[-1] is ErrorCode.BUSY, codes
        _, error = authenticate(node.address, "alice", SECRETS["alice"], source="127.0.0.2")
        assert error is ErrorCode.BUSY, "the address is held off, whatever it sends"
        with PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S) as alice:
            facts = alice.stats()[0]  # from 127.0.0.1: served
        assert facts["auth_failures"] == len(codes) - 1 and facts["auth_throttled"] == 2
        with PoolClient([node.address], tenant="bob", secret=b"wrong", timeout_s=WAIT_S) as bob:
            with pytest.raises(AuthFailed):  # judged, not throttled: 127.0.0.1 made no guesses
                bob.stats()

