"""A tenant of a real pool node asks for STATS to learn what other tenants do. What must hold: it
sees its own use, quota, blocks and counters and the node's static facts, never another tenant's
activity; the operator's credential sees the node-wide figures; `kvtier pool stats` shows what the
credential allows. Cost: about 2 s (one node start).
"""

from __future__ import annotations

import json

from kvtier.cli import main
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node
from support.pool import SECRETS, WAIT_S

NODE_WIDE = {"active_connections", "connections", "auth_failures", "refused_busy", "protocol_errors",
             "free_regions", "handshakes_pending", "handshakes_evicted", "accesses_in_flight",
             "region_handovers", "scrubbed_bytes", "lease_heap_entries"}


def test_a_tenant_sees_its_own_activity_only_and_the_operator_sees_the_node(tenants_file, capsys):
    with running_node(capacity="8MiB", region_size="256KiB", tenants=tenants_file,
                      credentials=("alice", SECRETS["alice"])) as node, \
            PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S) as alice, \
            PoolClient([node.address], tenant="bob", secret=SECRETS["bob"], timeout_s=WAIT_S) as bob:
        keys = [b"a%d" % i for i in range(3)]
        assert alice.batch_put(keys, [b"a" * 5000] * 3) == [True] * 3
        assert alice.batch_get(keys + [b"none"], [bytearray(5000) for _ in range(4)]) == [True] * 3 + [False]
        assert bob.put(b"b", b"b" * 5000) and bob.get(b"b", bytearray(5000)) and not bob.get(b"x", bytearray(1))
        mine = bob.stats()[0]
        assert (mine["hits"], mine["misses"], mine["puts"], mine["num_blocks"]) == (1, 1, 1, 1), "bob's own"
        assert mine["scope"] == "tenant" and not NODE_WIDE & mine.keys(), sorted(NODE_WIDE & mine.keys())
        assert mine["used_bytes"] == 8192 and mine["quota_bytes"] == 128 * 1024 and mine["bytes_in"] == 5000
        assert (mine["transport"], mine["region_bytes"], mine["capacity_bytes"]) == ("tcp", 256 * 1024, 8 << 20)
        node_wide = alice.stats()[0]
        assert node_wide["scope"] == "node" and (node_wide["hits"], node_wide["puts"]) == (4, 4)
        assert node_wide["num_blocks"] == 4 and node_wide["active_connections"] >= 2
        bob_key = str(tenants_file.parent / "bob.key")
        assert main(["pool", "stats", node.address, "--tenant", "bob", "--secret-file", bob_key, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["hits"] == 1
        assert main(["pool", "stats", node.address, "--tenant", "bob", "--secret-file", bob_key]) == 0
        table = capsys.readouterr().out
        assert "as this tenant sees it" in table and "connections" not in table and "used by this tenant" in table
