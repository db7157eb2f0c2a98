"""Lease floods against a real pool node: GETs that lease one key 4,096 times per frame and never
release. What must hold: past a bound per connection and per tenant the node answers LIMIT (an
error for that request only; nothing leased, the connection goes on), another tenant is not
affected, a closed connection's leases are gone with it and their memory with them, and a client
that meets LIMIT sees misses, never an error. Cost: about 4 s (two node starts).
"""

from __future__ import annotations

import os

from kvtier.pool.client.api import PoolClient
from kvtier.pool.detect import TransportKind
from kvtier.pool.protocol import ErrorCode, MsgType
from kvtier.pool.node.process import running_node
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
