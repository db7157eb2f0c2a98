"""Pool nodes as real `kvtier pool serve` subprocesses on 127.0.0.1, reached by real clients and by
raw sockets: sharing across processes, puts of stored keys and puts cut off mid-payload, placement
over several nodes, node loss and rejoin, authentication, tenant isolation, quotas, a fuzzed live
parser, leases under a read in flight, and the command line. Nothing waits on a timer: readiness is
the node's ready line plus an answered call; a frozen node is SIGSTOP. Cost: about 25 s on 2 cores
(a dozen node starts, client processes, timeouts of 0.5 s).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.cli import main
from kvtier.pool import wire
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.client.api import PoolClient, rendezvous_order
from kvtier.pool.client.connection import AuthFailed
from kvtier.pool.detect import rdma_devices
from kvtier.pool.protocol import MAX_HEADER_BYTES, PREFIX, VERSION, ErrorCode, MsgType, encode
from kvtier.pool.tenants import proof
from kvtier.pool.node.process import NodeProcess, running_node, start_nodes

KIB, MIB = 1024, 1 << 20
from support.pool import Raw, SECRETS, WAIT_S




def data_for(key: bytes, n: int) -> bytes:
    return hashlib.shake_128(key).digest(n)




@pytest.fixture(scope="module")
def node():
    with running_node(capacity="32MiB", region_size="4MiB") as n:
        yield n




@pytest.fixture(scope="module")
def secure_node(tenants_file):
    with running_node(capacity="8MiB", region_size="256KiB", tenants=tenants_file,
                      credentials=("alice", SECRETS["alice"])) as n:
        yield n


def client(node: NodeProcess, tenant: str = "default", **kw) -> PoolClient:
    return PoolClient([node.address], tenant=tenant, secret=SECRETS.get(tenant, b""), **{"timeout_s": WAIT_S, **kw})


# ---- sharing, placement, node loss ---------------------------------------------------------

CLIENT_SCRIPT = """
import hashlib, sys
from kvtier.pool.client.api import PoolClient
address, op, key, n = sys.argv[1], sys.argv[2], bytes.fromhex(sys.argv[3]), int(sys.argv[4])
with PoolClient([address], timeout_s=60) as c:
    if op == "put":
        print(c.put(key, hashlib.shake_128(key).digest(n)))
    else:
        buf = bytearray(n)
        print(c.get(key, buf), hashlib.sha256(buf).hexdigest())
"""


def test_two_client_processes_share_a_block(node):
    key, n = os.urandom(16), 3 * MIB + 123

    def run(op: str) -> list[str]:
        out = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, node.address, op, key.hex(), str(n)],
                             capture_output=True, text=True, timeout=60, check=True)
        return out.stdout.split()

    hits_before = client(node).stats()[0]["hits"]
    assert run("put") == ["True"]
    assert run("get") == ["True", hashlib.sha256(data_for(key, n)).hexdigest()]
    assert client(node).stats()[0]["hits"] == hits_before + 1


def test_a_put_of_a_stored_key_keeps_the_block_and_counts_the_bytes_sent_for_nothing(node):
    """The one-frame PUT sends the bytes before the node says EXISTS: the stored block stays as it
    was, the client counts put_exists, and the node counts the bytes it drained."""
    key, n = os.urandom(16), 100_000
    with client(node) as c:
        before = c.stats()[0]
        assert c.put(key, data_for(key, n))
        assert c.put(key, b"x" * n), "already stored counts as stored"
        buf = bytearray(n)
        assert c.get(key, buf) and bytes(buf) == data_for(key, n), "the first bytes stay"
        after = c.stats()[0]
        assert c.counters["put_exists"] == 1 and c.counters["puts"] == 1
    assert after["duplicate_put_bytes"] == before["duplicate_put_bytes"] + n
    assert after["bytes_in"] == before["bytes_in"] + n, "only the stored block's bytes went into the arena"


def test_a_put_cut_off_mid_payload_frees_its_slot_at_once(node):
    """A writer that goes away inside a PUT's bytes leaves no half block and no key held BUSY until
    its write lease (60 s here) expires: the next put of the key goes through."""
    key, n = os.urandom(16), 100_000
    raw = Raw(node.address)
    raw.sock.sendall(encode(MsgType.PUT, 1, {"key": key, "lease_s": 60, "checksum": 0}, n) + b"x" * (n // 2))
    raw.sock.shutdown(socket.SHUT_WR)
    assert raw.closed_by_peer(), "the node ends the connection once it has dropped the block"
    raw.close()
    with client(node) as c:
        assert c.contains([key]) == [False]
        assert c.put(key, data_for(key, n)), "not BUSY: the slot was freed when the bytes stopped"
        buf = bytearray(n)
        assert c.get(key, buf) and bytes(buf) == data_for(key, n)


def test_rendezvous_order_spreads_evenly_and_a_removed_node_moves_only_its_own_keys():
    nodes = [f"10.0.0.{i}:7000" for i in range(1, 5)]
    keys = [b"key-%05d" % i for i in range(4000)]
    homes = [rendezvous_order(nodes, k)[0] for k in keys]
    assert all(850 <= homes.count(i) <= 1150 for i in range(4)), [homes.count(i) for i in range(4)]
    assert [nodes[::-1][rendezvous_order(nodes[::-1], k)[0]] for k in keys] == [nodes[h] for h in homes]
    left = nodes[:2] + nodes[3:]  # node 2 removed: its keys go to their second choice, no other key moves
    moved = [left[rendezvous_order(left, k)[0]] != nodes[h] for k, h in zip(keys, homes)]
    assert moved == [h == 2 for h in homes]


def test_keys_spread_over_nodes_by_rendezvous_and_a_lost_node_is_only_misses():
    nodes = start_nodes(3, capacity="8MiB", region_size="256KiB")
    try:
        addresses = [n.address for n in nodes]
        keys = [b"key-%03d" % i for i in range(60)]
        blocks = [data_for(k, 20 * KIB) for k in keys]
        with PoolClient(addresses, timeout_s=WAIT_S, reconnect_s=3600) as c:
            assert c.batch_put(keys, blocks) == [True] * 60
            homes = [c.placement(k)[0] for k in keys]
            with PoolClient(list(reversed(addresses))) as other:  # the order of the node list does not matter
                assert all(other.links[other.home(k)].name == addresses[h] for k, h in zip(keys, homes))
            per_node = [s["num_blocks"] for s in c.stats()]
            assert per_node == [homes.count(i) for i in range(3)] and min(per_node) > 0
            nodes[1].kill()
            bufs = [bytearray(20 * KIB) for _ in keys]
            got = c.batch_get(keys, bufs)
            assert got == [h != 1 for h in homes], "exactly the lost node's keys miss"
            assert all(bytes(b) == d for b, d, ok in zip(bufs, blocks, got) if ok)
            assert c.counters["node_errors"] >= 1
            lost = [k for k, h in zip(keys, homes) if h == 1]
            assert c.batch_put(lost, [data_for(k, 20 * KIB) for k in lost]) == [True] * len(lost), \
                "while a node is down its keys go to their next node"
            assert all(c.home(k) == c.placement(k)[1] for k in lost)
            assert c.batch_get(lost, [bytearray(20 * KIB) for _ in lost]) == [True] * len(lost)
    finally:
        for n in nodes:
            n.close()


class PausingTransport(Transport):
    """Runs `before()` (freeze or kill the node) between the lookup and the one-sided read.
    Not `inline`: hits are leased and read one-sided, so there is a "between"."""

    name = "tcp"
    inline = False

    def __init__(self, inner: Transport, before) -> None:
        self.inner, self.before = inner, before

    def read(self, location: Location, dst: memoryview) -> bool:
        return self.read_many([RemoteIO(location, dst)])[0]

    def write(self, location: Location, src: memoryview) -> bool:
        return self.inner.write(location, src)

    def read_many(self, ios, landed=None):
        self.before()
        return self.inner.read_many(ios, landed)


@pytest.mark.slow
def test_a_node_frozen_or_killed_mid_get_is_a_miss_and_a_restarted_node_rejoins():
    node = NodeProcess(capacity="16MiB", region_size="4MiB")
    try:
        key, n = b"block", 4 * MIB
        with PoolClient([node.address], timeout_s=WAIT_S) as healthy:
            assert healthy.put(key, data_for(key, n))
        with PoolClient([node.address], timeout_s=0.5, reconnect_s=0) as c:
            real = c.transports[0]
            c.transports[0] = PausingTransport(real, node.pause)
            buf = bytearray(n)
            assert c.get(key, buf) is False, "frozen after the lookup: the read times out into a miss"
            c.transports[0] = real
            assert c.get(key, buf) is False, "frozen: the inline get times out into a miss"
            assert c.put(b"other", data_for(b"other", n)) is False, "and puts fail, never hang"
            assert c.counters["node_errors"] == 3 and c.counters.get("hits", 0) == 0
            node.kill()
            assert c.get(key, buf) is False and c.contains([key]) == [False]
            node.start()  # same address, empty memory
            c.links[0].timeout_s = WAIT_S  # from here on calls must succeed, however loaded the machine
            assert c.get(key, buf) is False, "the restarted node is empty"
            assert c.put(key, data_for(key, n)) and c.get(key, buf) and bytes(buf) == data_for(key, n)
    finally:
        node.close()


def test_a_node_killed_mid_payload_breaks_only_that_read():
    node = NodeProcess(capacity="64MiB", region_size="32MiB")
    try:
        with PoolClient([node.address], timeout_s=WAIT_S) as c:
            assert c.put(b"big", data_for(b"big", 32 * MIB))
        raw = Raw(node.address, rcvbuf=4096)
        (hit,) = raw.call(MsgType.GET, {"keys": [b"big"], "lease_s": 5, "release": [], "inline": False})["hits"]
        raw.send(MsgType.READ, {"region": hit[1], "offset": hit[2], "length": hit[3], "gen": hit[4]})
        msg, _, length = raw.recv()
        assert msg is MsgType.READ and length == 32 * MIB
        got = bytearray(MIB)
        raw.frames.recv_into(memoryview(got))
        node.kill()
        with pytest.raises(ConnectionError):
            raw.frames.recv_into(memoryview(bytearray(length - MIB)))
        assert got == data_for(b"big", 32 * MIB)[:MIB]
    finally:
        node.close()


# ---- security -------------------------------------------------------------------------------

def test_wrong_secret_or_unknown_tenant_is_refused_loudly(secure_node):
    before = client(secure_node, "alice").stats()[0]["auth_failures"]
    for tenant, secret in (("alice", b"wrong"), ("mallory", b"x"), ("bob", SECRETS["alice"])):
        with PoolClient([secure_node.address], tenant=tenant, secret=secret) as c:
            with pytest.raises(AuthFailed, match="authentication failed"):
                c.put(b"k", b"v")
    raw = Raw(secure_node.address, auth=False)
    raw.send(MsgType.STATS, {})
    msg, header, _ = raw.recv()
    assert msg is MsgType.ERROR and header["code"] == ErrorCode.AUTH and raw.closed_by_peer()
    assert client(secure_node, "alice").stats()[0]["auth_failures"] == before + 3


def test_a_tenant_sees_and_reaches_only_its_own_blocks(secure_node):
    with client(secure_node, "alice") as alice, client(secure_node, "bob") as bob:
        assert alice.put(b"shared-name", b"A" * 5000)
        assert bob.contains([b"shared-name"]) == [False] and not bob.get(b"shared-name", bytearray(5000))
        assert bob.put(b"shared-name", b"B" * 5000)
        buf = bytearray(5000)
        assert alice.get(b"shared-name", buf) and buf == b"A" * 5000
        assert bob.delete([b"shared-name"]) == 1 and alice.contains([b"shared-name"]) == [True]
    raw_alice = Raw(secure_node.address, "alice", SECRETS["alice"])
    (hit,) = raw_alice.call(MsgType.GET, {"keys": [b"shared-name"], "lease_s": 1, "release": [], "inline": False})["hits"]
    raw_bob = Raw(secure_node.address, "bob", SECRETS["bob"])
    forbidden = raw_alice.call(MsgType.STATS, {})["stats"]["forbidden"]
    probes = [({"region": hit[1], "offset": hit[2], "length": 100, "gen": hit[4]}, ErrorCode.STALE),
              ({"region": 10**6, "offset": 0, "length": 1, "gen": 1}, ErrorCode.BOUNDS)]
    for where, code in probes:
        raw_bob.send(MsgType.READ, where)
        msg, header, _ = raw_bob.recv()
        assert msg is MsgType.ERROR and header["code"] == code, "bob reads nothing of alice's"
    assert raw_alice.call(MsgType.STATS, {})["stats"]["forbidden"] == forbidden + 1, "the probe is counted"
    for where, code in [({"region": hit[1], "offset": hit[2], "length": 5001, "gen": hit[4]}, ErrorCode.BOUNDS),
                        ({"region": hit[1], "offset": hit[2] + 2**40, "length": 1, "gen": hit[4]}, ErrorCode.BOUNDS),
                        ({"region": hit[1], "offset": hit[2], "length": 10, "gen": hit[4] + 1}, ErrorCode.STALE)]:
        raw_alice.send(MsgType.READ, where)
        msg, header, _ = raw_alice.recv()
        assert msg is MsgType.ERROR and header["code"] == code, header
    raw_alice.send(MsgType.WRITE, {"region": hit[1], "offset": hit[2], "gen": hit[4]}, b"overwrite")
    msg, header, _ = raw_alice.recv()
    assert msg is MsgType.ERROR and header["code"] == ErrorCode.FORBIDDEN, "committed blocks are immutable"
    assert raw_alice.call(MsgType.STATS, {})["stats"]["tenant"]["name"] == "alice", "errors keep the connection"
    raw_alice.close()
    raw_bob.close()


def test_quota_evicts_the_tenants_own_blocks_then_refuses_when_all_are_leased(secure_node):
    with client(secure_node, "bob", lease_s=60) as bob, client(secure_node, "alice") as alice:
        assert alice.put(b"alice-block", b"a" * 64 * KIB)
        keys = [b"bob-%d" % i for i in range(4)]
        for k in keys:  # one at a time: blocks being written hold their quota until committed
            assert bob.put(k, data_for(k, 64 * KIB))
        tenant = bob.stats()[0]["tenant"]
        assert tenant["used_bytes"] <= tenant["quota_bytes"] == 128 * KIB
        assert bob.contains(keys) == [False, False, True, True]
        assert alice.contains([b"alice-block"]) == [True], "another tenant's quota never evicts mine"
        assert bob.batch_get(keys[2:], [bytearray(64 * KIB) for _ in range(2)]) == [True, True]
        reader = Raw(secure_node.address, "bob", SECRETS["bob"])  # leases both, as an RDMA reader would
        hits = reader.call(MsgType.GET, {"keys": keys[2:], "lease_s": 60, "release": [], "inline": False})["hits"]
        assert [h[0] and not h[7] for h in hits] == [True, True]
        assert bob.put(b"bob-4", b"x" * 64 * KIB) is False, "both blocks are leased: nothing to evict"
        assert bob.counters["put_rejected_quota"] == 1
        reader.call(MsgType.RELEASE, {"leases": [h[6] for h in hits]})
        assert bob.put(b"bob-4", b"x" * 64 * KIB), "released: the older of the two makes room"
        reader.close()


# ---- the parser, live ----------------------------------------------------------------------

def _expect_error_and_close(raw: Raw, code: ErrorCode) -> None:
    msg, header, _ = raw.recv()
    assert msg is MsgType.ERROR and header["code"] == code, header
    assert raw.closed_by_peer()


@pytest.mark.parametrize("auth", [False, True], ids=["before-auth", "after-auth"])
def test_oversized_and_other_version_frames_get_an_error_reply_and_a_close(node, auth):
    cases = [(PREFIX.pack(b"KT", VERSION, MsgType.STATS, 1, MAX_HEADER_BYTES + 1, 0), ErrorCode.TOO_LARGE),
             (PREFIX.pack(b"KT", VERSION, MsgType.WRITE, 1, 10, 1 << 31), ErrorCode.TOO_LARGE),
             (PREFIX.pack(b"KT", VERSION + 1, MsgType.STATS, 1, 1, 0) + b"\x80", ErrorCode.VERSION),
             (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", ErrorCode.MALFORMED)]
    for data, code in cases:
        raw = Raw(node.address, auth=auth)
        raw.sock.sendall(data)
        _expect_error_and_close(raw, code)
        raw.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(auth=st.booleans(), data=st.one_of(
    st.binary(max_size=300),
    st.builds(lambda t, body: PREFIX.pack(b"KT", VERSION, t, 1, len(body), 0) + body,
              st.integers(0, 255), st.binary(max_size=100))))
def test_fuzzed_frames_never_stop_the_node_serving_others(node, auth, data):
    raw = Raw(node.address, auth=auth)
    raw.sock.sendall(data)
    raw.sock.shutdown(socket.SHUT_WR)  # a truncated frame ends here: the node must not wait forever
    try:
        while True:
            prefix, msg, header = raw.frames.read_head(1 << 30, reply=True)
            raw.frames.drain(prefix.payload_len)
            assert msg is MsgType.ERROR or msg in MsgType, header
    except (EOFError, ConnectionError):
        pass
    raw.close()
    with client(node) as c:
        assert c.stats()[0]["transport"] == "tcp", "the node still answers everyone else"


# ---- leases and reads in flight --------------------------------------------------------------

def test_an_expired_lease_never_lets_a_slot_be_reused_under_a_read_in_flight():
    """Two slots of 24 MiB. A raw reader takes a lease of 0 s on K and starts reading it with a
    tiny receive window, so the node is still sending; a put that needs a slot must evict the
    other block. Once the read is over K's slot may go, and an old location then reads STALE."""
    size = 24 * MIB
    node = NodeProcess(capacity="48MiB", region_size="24MiB")
    try:
        with PoolClient([node.address], timeout_s=WAIT_S) as c:
            assert c.put(b"K", data_for(b"K", size)) and c.put(b"K3", data_for(b"K3", size))
            reader = Raw(node.address, rcvbuf=4096)
            (hit,) = reader.call(MsgType.GET, {"keys": [b"K"], "lease_s": 0, "release": [], "inline": False})["hits"]
            where = {"region": hit[1], "offset": hit[2], "length": hit[3], "gen": hit[4]}
            reader.send(MsgType.READ, where)
            assert reader.recv()[2] == size  # the reply has begun: the node is mid-send
            assert c.stats()[0]["accesses_in_flight"] == 1
            assert c.put(b"K2", data_for(b"K2", size)), "room is made by evicting K3, not K"
            assert c.contains([b"K", b"K2", b"K3"]) == [True, True, False]
            got = bytearray(size)
            reader.frames.recv_into(memoryview(got))
            assert got == data_for(b"K", size), "the read in flight got K's bytes, whole"
            assert c.put(b"K4", data_for(b"K4", size)), "now K is idle and its lease over: evicted"
            assert c.contains([b"K"]) == [False]
            reader.send(MsgType.READ, where)
            msg, header, _ = reader.recv()
            assert msg is MsgType.ERROR and header["code"] == ErrorCode.STALE, "an old location never reads new bytes"
            facts = c.stats()[0]
            assert facts["stale"] == 1 and facts["leases_expired"] >= 1 and facts["evictions"] == 2
    finally:
        node.close()


# ---- the command line -------------------------------------------------------------------------

def test_stats_command_reports_capacity_use_and_the_active_transport(node, capsys):
    with client(node) as c:
        assert c.put(b"stats-block", b"s" * 10_000) and c.get(b"stats-block", bytearray(10_000))
    assert main(["pool", "stats", node.address, "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["capacity_bytes"] == 32 * MIB and facts["used_bytes"] > 0 and facts["hits"] >= 1
    assert facts["transport"] == "tcp" and facts["transport_reason"] in ("no RDMA device",) + (
        (facts["transport_reason"],) if rdma_devices() else ())
    assert {"evictions", "misses", "num_blocks"} <= facts.keys()
    assert main(["pool", "stats", node.address]) == 0
    table = capsys.readouterr().out
    assert "tcp (" in table and "hits / misses" in table and "duplicate puts" in table
    assert node.ready["transport"] == "tcp"


def test_sigterm_shuts_down_gracefully():
    node = NodeProcess(capacity="4MiB")
    with PoolClient([node.address], timeout_s=WAIT_S) as c:
        assert c.put(b"k", b"v" * 100)
        assert node.terminate() == 0
        assert json.loads(node.proc.stdout.readline())["event"] == "stopped"
        assert c.get(b"k", bytearray(100)) is False
    node.close()


@pytest.mark.skipif(bool(rdma_devices()), reason="an RDMA device exists here")
def test_rdma_without_a_device_is_refused_with_the_reason(tmp_path):
    run = subprocess.run([sys.executable, "-m", "kvtier", "pool", "serve", "--listen", "127.0.0.1:0",
                          "--capacity", "4MiB", "--transport", "rdma"], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "no RDMA device" in run.stderr


def test_hugepages_are_used_or_the_reason_is_reported():
    with running_node(capacity="4MiB", region_size="2MiB", extra=["--hugepages"]) as n:
        assert n.ready["hugepages"] or "hugepages requested but unavailable" in n.ready["memory"]


def test_connections_beyond_the_limit_are_refused_with_busy():
    """Authenticated connections fill the limit; the next one is told BUSY. (Connections still in
    their handshake make room for new ones instead: tests/attacks/test_attack_pool_admission.py.)"""
    with running_node(capacity="4MiB", extra=["--max-connections", "2"]) as n:
        held: list[Raw] = []
        for _ in range(10):  # open until refused (the readiness probe's socket may still count for a moment)
            raw = Raw(n.address, auth=False)
            nonce = os.urandom(32)
            raw.send(MsgType.HELLO, {"tenant": "default", "nonce": nonce})
            msg, header, _ = raw.recv()
            if msg is MsgType.ERROR:
                assert header["code"] == ErrorCode.BUSY and raw.closed_by_peer()
                break
            raw.call(MsgType.AUTH, {"mac": proof(b"", b"client", "default", nonce, header["nonce"])})
            held.append(raw)
        assert 1 <= len(held) <= 2
        for raw in held:  # each one told it is authenticated holds its slot: none was evicted for the next
            assert raw.call(MsgType.CONTAINS, {"keys": [b"k"]}) is not None
            raw.close()
        with PoolClient([n.address], timeout_s=WAIT_S, reconnect_s=0) as c:
            for _ in range(1000):  # until the node has seen the closes: real calls, no timer
                if "error" not in (facts := c.stats()[0]):
                    break
            assert facts["refused_busy"] >= 1 and facts["active_connections"] <= 2
