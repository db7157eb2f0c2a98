"""The pool node's soft leases (RETAIN, RELEASE_HINT; issue 32): the store on a fake clock, then a real
`kvtier pool serve` on 127.0.0.1 (retained blocks outlive a flood, a released one goes first, another
tenant's hints touch nothing of A's, the budget, malformed frames), in-process nodes for the cap and
an older node, and the engine passing its hints on to the pool. Nothing sleeps: a deadline passes
on the fake clock, or a test waits on the node's own STATS.
Cost: about 6 s on 2 cores (one node subprocess, two in-process nodes, one runtime).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import config_from_dict
from kvtier.model.keys import Namespace, block_keys
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.config import NodeConfig
from kvtier.pool.node.process import running_node
from kvtier.pool.node.server import PoolNode
from kvtier.pool.node.store import BlockStore
from kvtier.pool.protocol import ErrorCode, GrantStatus, MsgType
from kvtier.pool.tenants import open_tenants
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.pool import Raw, wait_until
from support.runtime import LAYOUT, WAIT_S

KIB = 1024
REGION, BLOCK = 64 * KIB, 16 * KIB  # the store's: 4 blocks a region


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_store(clock: Clock, regions: int = 2, **kw) -> BlockStore:
    return BlockStore(regions * REGION, REGION, {"a": regions * REGION, "b": regions * REGION}, clock, **kw)


def put(store: BlockStore, key: bytes, tenant: str = "a") -> GrantStatus:
    g = store.put_begin(tenant, key, BLOCK, lease_s=30)
    if g.block is None:
        return g.status
    store.end_access(store.begin_access(tenant, g.block.region.id, g.block.offset, BLOCK, g.block.gen, True), True)
    assert store.commit(tenant, key, g.block.gen, checksum=1)
    return g.status


def held(store: BlockStore, keys: list[bytes], tenant: str = "a") -> list[bool]:
    return store.contains(tenant, keys)  # no touch: recency stays as the test left it


KEYS = [b"k%d" % i for i in range(8)]


def flood(store: BlockStore, n: int, tag: str = "f", tenant: str = "a") -> None:
    for i in range(n):
        assert put(store, f"{tag}{i}".encode(), tenant) is GrantStatus.GRANTED


# ---- the store, on a fake clock -------------------------------------------------------------------

def test_without_a_lease_a_flood_evicts_the_oldest_blocks() -> None:
    """The control: the same flood as below, no RETAIN, takes k0 and k1 first."""
    store = make_store(Clock())
    for k in KEYS:
        put(store, k)
    flood(store, 2)
    assert held(store, KEYS[:3]) == [False, False, True]


@pytest.mark.parametrize("quota_regions", [2, 4], ids=["tenant-at-quota", "node-full"])
def test_retained_blocks_outlive_a_flood_until_their_deadline(quota_regions) -> None:
    """Passed over by the tenant's own eviction at its quota, and by whole-region reclaim on a full node."""
    clock = Clock()
    store = BlockStore(2 * REGION, REGION, {"a": quota_regions * REGION}, clock)
    for k in KEYS:
        put(store, k)
    out = store.retain("a", KEYS[:4], ttl_s=10)  # the whole first region: its reclaim would take them all
    assert (out.retained, out.over_budget, out.missing) == (4, 0, 0)
    flood(store, 12)  # 8 slots: everything else of the tenant's goes, some of the flood too
    assert held(store, KEYS) == [True] * 4 + [False] * 4
    stats = store.tenant_stats("a")
    assert (stats["retained_blocks"], stats["retained_bytes"], stats["retained"]) == (4, 4 * BLOCK, 4)
    assert stats["retained_evicted"] == 0 and store.stats()["retained_blocks"] == 4  # the node-wide view too
    clock.now += 10  # the deadline: the leases lapse at the next eviction, with no timer
    flood(store, 4, "g")
    assert held(store, KEYS[:4]) == [False] * 4
    assert store.tenant_stats("a")["retained_blocks"] == 0 and store.stats()["retained_blocks"] == 0


def test_deadlines_only_grow_and_are_capped_by_max_retain_s() -> None:
    clock = Clock()
    store = make_store(clock, max_retain_s=30)
    for k in KEYS:
        put(store, k)
    store.retain("a", [KEYS[0]], ttl_s=20)
    store.retain("a", [KEYS[0]], ttl_s=1)  # shorter: the 20 s stand
    store.retain("a", [KEYS[1]], ttl_s=1e6)  # capped at 30 s
    clock.now += 15
    flood(store, 8)
    assert held(store, KEYS[:2]) == [True, True]
    clock.now += 10  # 25 s: k0's lease is over, k1's (30 s) is not
    flood(store, 1, "g")
    assert held(store, KEYS[:2]) == [False, True]
    clock.now += 5
    assert store.tenant_stats("a")["retained_blocks"] == 0


def test_a_tenant_retains_at_most_its_budget_and_the_rest_is_counted() -> None:
    store = make_store(Clock(), retain_fraction=0.25)  # a quarter of 8 slots
    for k in KEYS:
        put(store, k)
    out = store.retain("a", KEYS + [b"absent"], ttl_s=10)
    assert (out.retained, out.over_budget, out.missing) == (2, 6, 1)
    stats = store.tenant_stats("a")
    assert stats["retain_ignored_over_budget"] == 6 and stats["retained_blocks"] == 2
    assert stats["retain_quota_bytes"] == 2 * REGION // 4
    assert store.retain("a", KEYS[:2], ttl_s=20).retained == 2, "extending what is held costs no budget"


def test_a_lease_is_soft_a_put_is_never_refused_for_it() -> None:
    store = BlockStore(REGION, REGION, {"a": REGION}, Clock(), retain_fraction=1.0)
    for k in KEYS[:4]:
        put(store, k)
    assert store.retain("a", KEYS[:4], ttl_s=60).retained == 4
    assert put(store, b"new") is GrantStatus.GRANTED
    assert held(store, KEYS[:4]) == [False, True, True, True]
    stats = store.tenant_stats("a")
    assert stats["retained_evicted"] == 1 and stats["retained_blocks"] == 3


@pytest.mark.parametrize("quota_regions", [2, 4], ids=["tenant-at-quota", "node-full"])
def test_a_released_block_goes_first_and_loses_its_lease(quota_regions) -> None:
    """At its quota the tenant evicts its own oldest; on a full node under its quota the oldest block
    competes with the least recently used whole region: either way the released blocks go first."""
    store = BlockStore(2 * REGION, REGION, {"a": quota_regions * REGION}, Clock())
    for k in KEYS:
        put(store, k)
    store.retain("a", [KEYS[6]], ttl_s=60)
    assert store.release_hint("a", [KEYS[5], KEYS[6], b"absent"]) == 2
    flood(store, 2)
    assert held(store, KEYS) == [True] * 5 + [False, False, True]
    stats = store.tenant_stats("a")
    assert stats["released"] == 2 and stats["retained_blocks"] == 0


def test_another_tenant_can_neither_retain_nor_release_a_tenants_blocks() -> None:
    store = make_store(Clock())
    for k in KEYS:
        put(store, k)
    out = store.retain("b", KEYS, ttl_s=60)
    assert (out.retained, out.missing) == (0, 8)
    assert store.release_hint("b", [KEYS[7]]) == 0
    assert store.tenant_stats("a")["retained_blocks"] == 0 and store.tenant_stats("b")["retained_blocks"] == 0
    flood(store, 1)  # a's recency is its own: k0 goes, neither b's "lease" on it nor its "release" of k7 count
    assert held(store, [KEYS[0], KEYS[7]]) == [False, True]


# ---- a real node ----------------------------------------------------------------------------------

SECRETS = {name: f"{name}-secret-0123456789".encode() for name in ("ta", "tb", "tc")}
NODE_BLOCK = 64 * KIB  # 4 a region of 256 KiB; a tenant's 1 MiB quota is 16 blocks, 8 of them retainable


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    path = tmp_path_factory.mktemp("retain") / "tenants.yaml"
    path.write_text("tenants:\n" + "".join(f"  - {{name: {n}, secret: {s.decode()}, quota: 1MiB}}\n"
                                           for n, s in SECRETS.items()))
    with running_node(capacity="4MiB", region_size="256KiB", tenants=path, credentials=("ta", SECRETS["ta"])) as n:
        yield n


def client(address: str, tenant: str) -> PoolClient:
    return PoolClient([address], tenant=tenant, secret=SECRETS[tenant], timeout_s=WAIT_S, reconnect_s=0)


def data(key: bytes) -> bytes:
    return (key * (NODE_BLOCK // len(key) + 1))[:NODE_BLOCK]


def put_all(c: PoolClient, keys: list[bytes]) -> None:
    assert c.batch_put(keys, [data(k) for k in keys]) == [True] * len(keys)


def stats(c: PoolClient) -> dict:
    return c.stats()[0]


def test_node_keeps_retained_blocks_through_a_flood_and_drops_a_released_one_first(node) -> None:
    keys = [b"a-%02d" % i for i in range(16)]
    with client(node.address, "ta") as a:
        put_all(a, keys)  # the tenant's whole quota
        assert a.retain(keys[:4], ttl_s=600) == {"retained": 4, "over_budget": 0, "missing": 0,
                                                  "not_served": 0, "failed": 0}
        assert a.release_hint([keys[10]])["released"] == 1
        put_all(a, [b"a-flood-0"])
        assert a.contains([keys[10]]) == [False], "the released block was the first to go"
        put_all(a, [b"a-flood-%d" % i for i in range(1, 16)])
        assert a.contains(keys) == [True] * 4 + [False] * 12
        facts = stats(a)
        assert (facts["retained_blocks"], facts["retained_bytes"]) == (4, 4 * NODE_BLOCK)
        assert (facts["retained"], facts["released"], facts["retained_evicted"]) == (4, 1, 0)


def test_node_counts_a_retain_over_the_tenants_budget(node) -> None:
    keys = [b"b-%02d" % i for i in range(10)]
    with client(node.address, "tb") as b:
        put_all(b, keys)
        got = b.retain(keys, ttl_s=600)
        assert (got["retained"], got["over_budget"]) == (8, 2)
        facts = stats(b)
        assert facts["retain_ignored_over_budget"] == 2 and facts["retained_blocks"] == 8
        assert facts["retain_quota_bytes"] == (1 << 20) // 2


def test_another_tenants_hints_leave_a_tenants_blocks_alone(node) -> None:
    keys = [b"c-%02d" % i for i in range(4)]
    with client(node.address, "tc") as c, client(node.address, "tb") as b:
        put_all(c, keys)
        before = stats(c)
        assert b.retain(keys, ttl_s=600)["missing"] == 4
        assert b.release_hint(keys)["released"] == 0
        after = stats(c)
        for name in ("retained_blocks", "released", "retained", "evictions"):
            assert after[name] == before[name], name
        assert c.contains(keys) == [True] * 4


@pytest.mark.parametrize("header", [{"keys": [b"k"], "ttl_s": -1}, {"keys": [b"k"], "ttl_s": float("inf")},
                                    {"keys": [b"k"]}, {"keys": "k", "ttl_s": 1}, {"keys": [b""], "ttl_s": 1}])
def test_node_refuses_a_malformed_retain_and_serves_on(node, header) -> None:
    raw = Raw(node.address, "ta", SECRETS["ta"])
    raw.send(MsgType.RETAIN, header)
    msg, reply, _ = raw.recv()
    assert msg is MsgType.ERROR and reply["code"] == ErrorCode.MALFORMED
    assert raw.closed_by_peer()
    raw.close()
    with client(node.address, "ta") as a:
        assert a.retain([b"never-stored"], ttl_s=1)["missing"] == 1


def test_a_lease_lapses_at_the_nodes_max_retain_s() -> None:
    """An in-process node with a short cap: a RETAIN of an hour lapses within it (waited for on STATS)."""
    n = PoolNode(NodeConfig("127.0.0.1", 0, 1 << 20, open_tenants(1 << 20), region_bytes=256 * KIB,
                            max_retain_s=0.2))
    n.start()
    try:
        host, port = n.address
        with PoolClient([f"{host}:{port}"], timeout_s=WAIT_S, reconnect_s=0) as c:
            put_all(c, [b"short"])
            assert c.retain([b"short"], ttl_s=3600)["retained"] == 1
            assert c.retain([b"short"], ttl_s=0)["retained"] == 0, "a ttl of 0 asks for nothing"
            wait_until(lambda: stats(c)["tenant"]["retained_blocks"] == 0, "the lease lapsed at the node's cap")
    finally:
        n.stop()


def test_a_node_older_than_retain_is_counted_never_marked_down() -> None:
    """An in-process node without the RETAIN / RELEASE_HINT handlers answers MALFORMED and closes, as
    a node from before them does: each is probed once, its keys counted `not_served`, nothing raises."""
    old = PoolNode(NodeConfig("127.0.0.1", 0, 1 << 20, open_tenants(1 << 20), region_bytes=256 * KIB))
    old.start()
    old._control.pop(MsgType.RETAIN)
    old._control.pop(MsgType.RELEASE_HINT)
    try:
        host, port = old.address
        with PoolClient([f"{host}:{port}"], timeout_s=WAIT_S, reconnect_s=60) as c:
            put_all(c, [b"old"])
            for _ in range(2):
                assert c.retain([b"old"], ttl_s=10)["not_served"] == 1
                assert c.release_hint([b"old"])["not_served"] == 1
            assert not c.links[0].down and c.contains([b"old"]) == [True]
            assert c.counters["retain_not_served"] == 2 and c.counters["release_hint_not_served"] == 2
        assert old.stats()["protocol_errors"] == 2, "one probe per message, not one per call"
    finally:
        old.stop()


# ---- the engine passes its hints on ----------------------------------------------------------------

def test_the_engines_hints_reach_the_pool_node_off_the_callers_thread(node) -> None:
    keys = block_keys(Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens),
                      list(range(3 * LAYOUT.block_tokens)))
    cfg = config_from_dict({"model": "kvtier-tiny", "tiers": {
        "dram": {"capacity": LAYOUT.block_bytes, "high_watermark": 1.0, "low_watermark": 1.0},
        "pool": {"capacity": 16 * LAYOUT.block_bytes, "nodes": [node.address], "tenant": "tc",
                 "secret": SECRETS["tc"].decode(), "timeout_s": WAIT_S, "reconnect_s": 0,
                 "high_watermark": 1.0, "low_watermark": 1.0}}})
    with KVTier(cfg, layout=LAYOUT) as kv, client(node.address, "tc") as c:
        rows = torch.stack([torch.full((LAYOUT.block_bytes,), i, dtype=torch.uint8) for i in range(3)])
        handle = kv.store(keys, rows, target=TierKind.POOL)
        assert handle.wait(WAIT_S) and not handle.failed, handle.failed
        kv.quiesce(WAIT_S)
        before = stats(c)
        pool = kv.tiers[TierKind.POOL]
        assert kv.apply_hint(keys, session="s-1", retain_s=600)
        assert pool.hints.wait_idle(WAIT_S)
        assert stats(c)["retained_blocks"] == before["retained_blocks"] + 3
        assert kv.apply_hint(keys, session="s-1", closed=True)
        assert pool.hints.wait_idle(WAIT_S)
        after = stats(c)
        assert after["released"] == before["released"] + 3
        assert after["retained_blocks"] == before["retained_blocks"]
        counts = kv.snapshot()["pool_client"]
        assert (counts["hint_retained"], counts["hint_released"]) == (3, 3)
