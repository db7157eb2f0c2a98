"""Lease floods against a real pool node: GETs that lease one key 4,096 times per frame and never
release. What must hold: past a bound per connection and per tenant the node answers LIMIT (an
error for that request only; nothing leased, the connection goes on), another tenant is not
affected, a closed connection's leases are gone with it and their memory with them, a flood's
memory comes back once its leases expire (issue 29: 56 -> 126 MB, still 122 MB after), and a
client that meets LIMIT sees misses, never an error. Another tenant's worst get during a flood is
wall-clock, measured by bench/bench_lease_flood.py. Cost: about 15 s (three node starts, one flood
of 1,280 frames and its expiry).
"""

from __future__ import annotations

import gc
import os
import threading

import pytest

from kvtier.pool.client.api import PoolClient
from kvtier.pool.detect import TransportKind
from kvtier.pool.protocol import ErrorCode, MsgType
from kvtier.pool.node.memory import can_trim, trim_malloc
from kvtier.pool.node.process import running_node
from kvtier.pool.node.store import MAX_LEASES_PER_OWNER, MAX_LEASES_PER_TENANT, BlockStore
from kvtier.testing.lease_flood import FLOOD_KEY, LeaseFlood, rss_bytes
from kvtier.testing.pool import rdma_node
from support.pool import wait_until
from support.pool import SECRETS, WAIT_S, Raw

FLOOD = {"keys": [b"k"] * 4096, "lease_s": 60, "release": [], "inline": False}


def flood(raw: Raw) -> tuple[MsgType, dict]:
    raw.send(MsgType.GET, FLOOD)
    msg, header, _ = raw.recv()
    return msg, header


def test_a_lease_flood_is_bounded_per_connection_and_tenant_and_ends_with_the_connection(tenants_file):
    extra = ["--max-leases-per-connection", "5000", "--max-leases-per-tenant", "9000"]
    with running_node(capacity="4MiB", region_size="256KiB", tenants=tenants_file, extra=extra,
                      credentials=("alice", SECRETS["alice"])) as node:
        for tenant in ("alice", "bob"):
            with PoolClient([node.address], tenant=tenant, secret=SECRETS[tenant], timeout_s=WAIT_S) as c:
                assert c.put(b"k", b"x" * 5000)
        operator = Raw(node.address, "alice", SECRETS["alice"])
        stats = lambda: operator.call(MsgType.STATS, {})["stats"]
        first, second = (Raw(node.address, "bob", SECRETS["bob"]) for _ in range(2))
        assert flood(first)[0] is MsgType.GET
        msg, header = flood(first)
        assert msg is MsgType.ERROR and header["code"] == ErrorCode.LIMIT, "past 5000 on this connection"
        assert "release some" in header["message"]
        assert flood(second)[0] is MsgType.GET
        assert flood(second)[1]["code"] == ErrorCode.LIMIT, "past 9000 for the tenant"
        assert stats()["tenant"]["name"] == "alice" and stats()["active_leases"] == 8192
        assert all(h[0] for h in flood(operator)[1]["hits"]), "another tenant still leases"
        assert first.call(MsgType.CONTAINS, {"keys": [b"k"]})["found"] == [True], "LIMIT kept the connection"
        first.close()
        second.close()
        wait_until(lambda: stats()["active_leases"] == 4096, "the closed connections' leases gone")
        facts = stats()
        assert facts["leases_dropped_on_close"] == 8192 and facts["rejected_limit"] == 2
        assert facts["lease_heap_entries"] <= 2 * facts["active_leases"] + 1024, "their memory is back"
        operator.close()


def test_a_client_that_meets_the_lease_limit_sees_misses_and_goes_on(tmp_path):
    """Over RDMA every hit is leased: with 2 leases per connection, a get of 4 keys is refused
    whole (misses, counted), and gets of 2 keys, each releasing the last one's leases, go on."""
    extra = ["--max-leases-per-connection", "2"]
    with rdma_node("fake", tmp_path, capacity="4MiB", region_size="256KiB", extra=extra) as node:
        keys = [os.urandom(16) for _ in range(4)]
        with PoolClient([node.address], timeout_s=WAIT_S) as tcp:
            assert tcp.batch_put(keys, [k * 100 for k in keys]) == [True] * 4
        with PoolClient([node.address], timeout_s=WAIT_S, transport=TransportKind.RDMA,
                        verbs=node.verbs) as c:
            assert c.batch_get(keys, [bytearray(1600) for _ in keys]) == [False] * 4
            assert c.counters["lease_limit"] == 1 and c.counters["misses"] == 4
            for _ in range(3):
                bufs = [bytearray(1600) for _ in range(2)]
                assert c.batch_get(keys[:2], bufs) == [True, True] and bufs == [k * 100 for k in keys[:2]]


FLOOD_CONNECTIONS, FLOOD_FRAMES = 10, 128  # 1,280 GETs of 4,096 leases, ten times the tenant's bound
RSS_AFTER_OVER_BEFORE = 1.25


class Reader:
    """alice's gets of her own blocks, in a loop on a thread, until `stop`: each hit or not."""

    def __init__(self, client: PoolClient, keys: list[bytes]) -> None:
        self.client, self.keys, self.results = client, keys, []
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        into = bytearray(4096)
        try:
            while not self._stop.is_set():
                self.results.append(self.client.get(self.keys[len(self.results) % len(self.keys)], into))
        except BaseException as e:  # re-raised by `stop`, in the test's thread
            self.error = e

    def stop(self) -> list[bool]:
        self._stop.set()
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.results


@pytest.mark.slow
def test_a_flood_at_the_tenant_bound_gives_its_memory_back_when_its_leases_expire(tenants_file):
    """bob floods from ten connections that stay open; leases last 3 s at most. While it floods,
    alice's gets are all served; once every lease has expired, the lease table is empty (no slot,
    no heap entry), and the node's resident memory is within 25% of what it was before the flood
    (its connections open then too: their threads and buffers are not the leases')."""
    extra = ["--max-lease-s", "3"]
    with running_node(capacity="8MiB", region_size="256KiB", tenants=tenants_file, extra=extra,
                      credentials=("alice", SECRETS["alice"])) as node, \
            PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S) as alice:
        keys = [b"alice-%d" % i for i in range(8)]
        assert alice.batch_put(keys, [bytes([i]) * 4096 for i in range(len(keys))]) == [True] * len(keys)
        with PoolClient([node.address], tenant="bob", secret=SECRETS["bob"], timeout_s=WAIT_S) as bob:
            assert bob.put(FLOOD_KEY, b"x" * 4096)
        stats = lambda: alice.stats()[0]  # alice holds the operator's credential: node-wide figures
        flood = LeaseFlood(node.address, "bob", SECRETS["bob"], FLOOD_CONNECTIONS, FLOOD_FRAMES)
        try:
            rss_before = rss_bytes(node.proc.pid)
            reader = Reader(alice, keys)
            counts = flood.run()
            served = reader.stop()
            assert counts.num_refused and counts.num_leased * 4096 >= MAX_LEASES_PER_TENANT, counts
            assert served and all(served), f"alice: {served.count(False)} of {len(served)} gets missed"
            assert stats()["lease_slots"] >= MAX_LEASES_PER_TENANT, "the flood reached the tenant's bound"
            wait_until(lambda: stats()["active_leases"] == 0, "every lease expired")
            facts = stats()
            assert facts["leases_expired"] == counts.num_leased * 4096 and facts["rejected_limit"] == counts.num_refused
            wait_until(lambda: stats()["lease_slots"] == 0, "the lease table given back")
            assert stats()["lease_heap_entries"] == 0
            if can_trim():  # glibc: the node trims its heap once the table is given back
                wait_until(lambda: stats()["malloc_trims"] >= 1, "the node's heap trimmed")
            rss_after = rss_bytes(node.proc.pid)
            assert rss_after <= RSS_AFTER_OVER_BEFORE * rss_before, (rss_before >> 20, rss_after >> 20)
        finally:
            flood.close()


def test_a_lease_is_no_object_the_collector_tracks_and_the_table_shrinks_when_they_go():
    """The lease table is columns (kvtier.pool.node.leases): a tenant's bound of leases adds no
    object per lease for the garbage collector to walk (their objects made full collections of
    60-200 ms, with the GIL held, under a flood), and once they expire their slots and heap go."""
    now = [100.0]
    store = BlockStore(1 << 20, 1 << 20, {"a": 1 << 20}, lambda: now[0])
    grant = store.put_begin("a", b"k", 4096, lease_s=30)
    access = store.begin_access("a", grant.block.region.id, grant.block.offset, 4096, grant.block.gen, write=True)
    store.end_access(access, ok=True)
    assert store.commit("a", b"k", grant.block.gen, 0)
    gc.collect()
    before = len(gc.get_objects())
    for owner in range(MAX_LEASES_PER_TENANT // MAX_LEASES_PER_OWNER):  # each connection at its bound
        for _ in range(MAX_LEASES_PER_OWNER // 4096):
            store.get("a", [b"k"] * 4096, 30, owner=owner)
        now[0] += owner % 2  # several expiry times
    gc.collect()
    assert store.stats()["active_leases"] == MAX_LEASES_PER_TENANT
    # Other threads of the test process (a finished test's workers) may leave a few objects; an
    # object per lease would be MAX_LEASES_PER_TENANT of them.
    assert len(gc.get_objects()) - before < MAX_LEASES_PER_TENANT // 100, "no object per lease"
    now[0] += 60
    while store.expire(4096):
        pass
    facts = store.stats()
    assert facts["active_leases"] == 0 and facts["lease_slots"] == 0 and facts["lease_heap_entries"] == 0
    assert trim_malloc() in (True, False)  # glibc's heap given back where there is glibc; never raises
