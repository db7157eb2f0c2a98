"""The pool shared by key through `KVTier` itself: a block one process stores (or demotes) into the
pool is found and loaded by another process of the tenant, whole or layer range by layer range;
lookups batch and remember misses briefly; a block the pool holds already is not sent again; one
the node dropped is a counted miss, never wrong bytes; keys that are not `BlockKey`s stay private.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier.config import config_from_dict
from kvtier.model.keys import Namespace, block_keys
from kvtier.pool.client.api import PoolClient, rendezvous_order
from kvtier.pool.client.streamed import BlockFrame
from kvtier.pool.node.process import NodeProcess, running_node
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.runtime import LAYOUT, WAIT_S

P = TierKind.POOL
pytestmark = pytest.mark.slow  # seconds per test (node and writer subprocesses): kept out of `make test-fast`
SECRET, OTHER = "shared-secret-123456", "other-secret-654321"
NAMESPACE = Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens)
KEYS = block_keys(NAMESPACE, list(range(8 * LAYOUT.block_tokens)))  # 8 chained BlockKeys

# Another process: a KVTier with a one-block DRAM tier over the pool; stores its blocks (bytes
# derived from each key) and exits. argv: node address, YAML-ready config as JSON, how to store.
WRITER = r"""
import json, sys, torch
from kvtier.config import config_from_dict
from kvtier.model.layout import BlockLayout
from kvtier.model.keys import Namespace, block_keys
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
layout = BlockLayout.uniform(block_tokens=4, num_layers=4, layer_bytes=4096)
keys = block_keys(Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=4), list(range(32)))
n, how = int(sys.argv[2]), sys.argv[3]
with KVTier(config_from_dict(json.loads(sys.argv[1])), layout=layout) as kv:
    data = torch.stack([torch.frombuffer(bytearray((k * (layout.block_bytes // 16 + 1))[:layout.block_bytes]),
                                         dtype=torch.uint8) for k in keys[:n]])
    batches = [(keys[:n], data)] if how == "pool" else [([k], data[i:i + 1]) for i, k in enumerate(keys[:n])]
    for batch, rows in batches:  # "dram": one by one into DRAM, each pushing the one before down
        handle = kv.store(batch, rows, target=TierKind.POOL if how == "pool" else None)
        assert handle.wait(30) and not handle.failed, handle.failed
        kv.quiesce(30)
    print(json.dumps({"where": [t.name if t else None for t in kv.where(keys[:n])], **kv.snapshot()}, default=str))
"""


def expected(key: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray((key * (LAYOUT.block_bytes // 16 + 1))[:LAYOUT.block_bytes]), dtype=torch.uint8)


def config(address: str, **pool) -> dict:
    return {"model": "kvtier-tiny", "transfer": pool.pop("transfer", {}), "tiers": {
        "dram": {"capacity": LAYOUT.block_bytes, "high_watermark": 1.0, "low_watermark": 1.0},
        "pool": {"capacity": 16 * LAYOUT.block_bytes, "nodes": [address], "tenant": "serving", "secret": SECRET,
                 "timeout_s": WAIT_S, "reconnect_s": 0, "high_watermark": 1.0, "low_watermark": 1.0, **pool}}}


def write_from_another_process(address: str, n: int, how: str, **pool) -> dict:
    return run_writer(config(address, **pool), n, how)


def run_writer(cfg: dict, n: int, how: str) -> dict:
    done = subprocess.run([sys.executable, "-c", WRITER, json.dumps(cfg), str(n), how],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def load(kv: KVTier, keys) -> tuple[torch.Tensor, dict]:
    out = torch.zeros(len(keys), LAYOUT.block_bytes, dtype=torch.uint8)
    handle = kv.load(keys, out)
    handle.wait(WAIT_S)  # False where a block failed: the caller looks at which
    return out, handle.failed


NODE = {"capacity": "4MiB", "region_size": "256KiB", "credentials": ("serving", SECRET.encode())}


def tenants_yaml(tmp_path, quota: int | None = None) -> Path:
    path = tmp_path / "tenants.yaml"
    limit = f", quota: {quota}" if quota else ""
    path.write_text(f"tenants:\n  - {{name: serving, secret: {SECRET}{limit}}}\n  - {{name: other, secret: {OTHER}}}\n")
    return path


@pytest.fixture
def node(tmp_path):
    with running_node(tenants=tenants_yaml(tmp_path), **NODE) as n:
        yield n


def homes(addresses: list[str]) -> list[int]:
    """The node (index into `addresses`) each of KEYS lives on, as rendezvous hashing places it."""
    return [rendezvous_order(addresses, bytes(k))[0] for k in KEYS]


@pytest.fixture
def two_nodes(tmp_path):
    """Two nodes that KEYS spread over. Their ports are the kernel's pick, so now and then (1 in 128)
    rendezvous puts all 8 keys on one: that pair says nothing about spreading, another is started."""
    nodes = []
    try:
        nodes += [NodeProcess(tenants=tenants_yaml(tmp_path), **NODE) for _ in range(2)]
        for _ in range(20):
            if len(set(homes([n.address for n in nodes]))) == 2:
                break
            nodes.append(NodeProcess(tenants=tenants_yaml(tmp_path), **NODE))
            nodes.pop(0).close()
        assert len(set(homes([n.address for n in nodes]))) == 2, "20 node pairs, every one held all 8 keys on one node"
        yield nodes
    finally:
        for n in nodes:
            n.close()


@pytest.mark.parametrize("how", ["pool", "through", "demoted"])
def test_blocks_another_process_stored_are_found_and_loaded(node, how) -> None:
    """Stored straight into the pool; stored into DRAM and written through to the pool (the
    default for blocks the pool shares); or stored into DRAM alone, reaching the pool as demoted."""
    pool = {"write_through": False} if how == "demoted" else {}
    wrote = write_from_another_process(node.address, 4, "pool" if how == "pool" else "dram", **pool)
    if how == "demoted":  # a one-block DRAM tier: each store pushed the block before down to the pool
        assert wrote["demotions"]["dram->pool"] >= 1 and wrote["where"].count("POOL") >= 3, wrote
    if how == "through":  # every block is on the pool at once, with no demotion; the last stays in DRAM too
        assert "dram->pool" not in wrote["demotions"] and wrote["where"][-1] == "DRAM", wrote
        assert wrote["stores"] == {"dram": 4, "pool": 4}, wrote
        wrote["where"] = ["POOL"] * 4
    with KVTier(config_from_dict(config(node.address)), layout=LAYOUT) as kv:
        leading = next((i for i, w in enumerate(wrote["where"]) if w != "POOL"), 4)
        assert kv.lookup(KEYS[:4]) == leading
        pooled = [k for k, w in zip(KEYS[:4], wrote["where"]) if w == "POOL"]
        assert kv.lookup(pooled) == len(pooled)
        got, failed = load(kv, pooled)
        assert not failed
        for row, key in zip(got, pooled):
            assert torch.equal(row, expected(key))
        snap = kv.snapshot()
        assert snap["hits"] == {"pool": len(pooled)}
        assert snap["shared"]["adopted"] == len(pooled)


def test_layer_ranges_are_gathered_on_store_and_streamed_from_one_get(node) -> None:
    """chunk_bytes 0: every layer is its own span, so a store writes a block in four parts and a
    load reads it in four; the pool still sees one whole, checked object each way (16 KiB blocks:
    stored plain, no header; see test_pool_streamed for the framed ones)."""
    write_from_another_process(node.address, 4, "pool", transfer={"chunk_bytes": 0})
    assert not BlockFrame(LAYOUT.block_bytes).framed
    with PoolClient([node.address], tenant="serving", secret=SECRET.encode()) as client:
        assert client.contains([bytes(k) for k in KEYS[:4]]) == [True] * 4
        whole = bytearray(LAYOUT.block_bytes)
        assert client.get(bytes(KEYS[2]), whole) and bytes(whole) == bytes(expected(KEYS[2]).numpy())
    cfg = config(node.address, transfer={"chunk_bytes": 0})
    with KVTier(config_from_dict(cfg), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:4]) == 4
        got, failed = load(kv, KEYS[:4])
        assert not failed and all(torch.equal(r, expected(k)) for r, k in zip(got, KEYS[:4]))
        assert kv.snapshot()["pool_client"]["hits"] == 4  # one get per block, for its four layer reads


def test_misses_are_asked_once_per_node_then_remembered_briefly(node) -> None:
    write_from_another_process(node.address, 2, "pool")
    with KVTier(config_from_dict(config(node.address, negative_cache_s=60)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:6]) == 2  # asks for all six at once; 2 found, 4 absent
        assert kv.snapshot()["shared"] == {"adopted": 2, "asked": 6, "found": 2}
        assert kv.lookup(KEYS[:6]) == 2  # the two adopted are asked again (still there?); the four are not
        assert kv.snapshot()["shared"] == {"adopted": 2, "asked": 8, "found": 4, "negative_cached": 4}
    with KVTier(config_from_dict(config(node.address, negative_cache_s=0)), layout=LAYOUT) as kv:
        kv.lookup(KEYS[2:4])
        kv.lookup(KEYS[2:4])
        assert kv.snapshot()["shared"] == {"asked": 4}  # no cache: both misses asked both times


def test_a_block_the_pool_holds_is_not_sent_again(node) -> None:
    """Loading four adopted blocks through a one-block DRAM tier promotes them, and each promotion
    demotes the block before it back to the pool: every such demotion finds the block there and
    sends nothing."""
    write_from_another_process(node.address, 4, "pool")
    with KVTier(config_from_dict(config(node.address)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:4]) == 4
        for key in KEYS[:4]:
            got, failed = load(kv, [key])
            assert not failed and torch.equal(got[0], expected(key))
            kv.quiesce(WAIT_S)
        snap = kv.snapshot()
        demoted = snap["demotions"]["dram->pool"]
        assert demoted >= 1 and snap["promotions"]["pool->dram"] >= demoted
        assert snap["shared"]["deduplicated"] == demoted
        assert kv.tiers[P]._client.counters.get("puts", 0) == 0  # not one block sent
        assert kv.lookup(KEYS[:4]) == 4 and not load(kv, KEYS[:4])[1]


def test_a_block_the_node_dropped_is_a_counted_miss_never_wrong_bytes(node) -> None:
    write_from_another_process(node.address, 3, "pool")
    with KVTier(config_from_dict(config(node.address)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:3]) == 3
        with PoolClient([node.address], tenant="serving", secret=SECRET.encode()) as other:
            assert other.delete([bytes(KEYS[1])]) == 1
        got, failed = load(kv, KEYS[:3])
        assert set(failed) == {KEYS[1]}
        assert torch.equal(got[0], expected(KEYS[0])) and torch.equal(got[2], expected(KEYS[2]))
        snap = kv.snapshot()
        assert snap["io_errors"] == 1 and snap["dropped"] == {"read_io_error": 1}
        assert kv.lookup(KEYS[:3]) == 1  # gone from the index too; asked again, absent


def test_keys_that_are_not_block_keys_stay_private(node) -> None:
    cfg = config(node.address)
    with KVTier(config_from_dict(cfg), layout=LAYOUT) as a, KVTier(config_from_dict(cfg), layout=LAYOUT) as b:
        own = ["plain-string-key", 7]
        handle = a.store(own, torch.stack([expected(bytes(16))] * 2), target=P)
        assert handle.wait(WAIT_S) and not handle.failed
        assert a.lookup(own) == 2 and b.lookup(own) == 0
        assert "asked" not in b.snapshot()["shared"]


def test_sharing_off_keeps_every_block_private(node) -> None:
    write_from_another_process(node.address, 2, "pool", shared=False)
    with PoolClient([node.address], tenant="serving", secret=SECRET.encode()) as client:
        assert client.contains([bytes(k) for k in KEYS[:2]]) == [False, False]
    with KVTier(config_from_dict(config(node.address, shared=False)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:2]) == 0 and kv.snapshot()["shared"] == {}


def test_another_tenant_finds_nothing(node) -> None:
    write_from_another_process(node.address, 2, "pool")
    with KVTier(config_from_dict(config(node.address, tenant="other", secret=OTHER)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:2]) == 0
        assert kv.snapshot()["shared"] == {"asked": 2}


# ---- several nodes, a node lost and back, the tenant's quota -------------------------------------


def many_nodes(address_list: list[str], **pool) -> dict:
    cfg = config(address_list[0], **pool)
    cfg["tiers"]["pool"]["nodes"] = list(address_list)
    return cfg


def test_blocks_spread_over_nodes_by_rendezvous_and_every_process_agrees(two_nodes) -> None:
    addresses = [n.address for n in two_nodes]
    run_writer(many_nodes(addresses), 8, "pool")
    held = []
    for address in addresses:
        with PoolClient([address], tenant="serving", secret=SECRET.encode()) as one:
            held.append(sum(one.contains([bytes(k) for k in KEYS])))
    placed = homes(addresses)
    # each node holds exactly what rendezvous hashing gives it (some on each), none a block twice
    assert held == [placed.count(0), placed.count(1)] and min(held) >= 1, (held, placed)
    # the other process lists the nodes the other way round: placement does not depend on the order
    with KVTier(config_from_dict(many_nodes(addresses[::-1])), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS) == 8
        got, failed = load(kv, KEYS)
        assert not failed and all(torch.equal(r, expected(k)) for r, k in zip(got, KEYS))


def test_a_lost_node_is_misses_within_the_timeout_and_a_restarted_one_rejoins(two_nodes) -> None:
    nodes, addresses = two_nodes, [n.address for n in two_nodes]
    # reconnect_s 0: a failed node is tried again on the next call, so the restarted node takes
    # blocks as soon as it is up (with the default 1 s, a restart within that second left it
    # skipped and every fresh block homed on the other node: CI saw it, under load)
    fast = {"timeout_s": 1.0, "negative_cache_s": 0, "reconnect_s": 0}
    run_writer(many_nodes(addresses, **fast), 8, "pool")
    with PoolClient([addresses[1]], tenant="serving", secret=SECRET.encode()) as one:
        on_second = {k for k in KEYS if one.contains([bytes(k)])[0]}
    assert 0 < len(on_second) < 8
    with KVTier(config_from_dict(many_nodes(addresses, **fast)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS) == 8
        nodes[1].kill()
        got, failed = load(kv, KEYS)  # the adopted blocks of the dead node: misses, the rest served
        assert set(failed) == on_second
        assert all(torch.equal(r, expected(k)) for r, k in zip(got, KEYS) if k not in on_second)
        survivors = [k for k in KEYS if k not in on_second]
        assert kv.lookup(survivors) == len(survivors) and not load(kv, survivors)[1]
        nodes[1].start()  # back on the same address, empty: it rejoins for new blocks
        kv.recheck()
        fresh = block_keys(NAMESPACE, list(range(1000, 1000 + 8 * LAYOUT.block_tokens)))
        handle = kv.store(fresh, torch.stack([expected(k) for k in fresh]), target=P)
        assert handle.wait(WAIT_S) and not handle.failed, handle.failed
        with PoolClient([addresses[1]], tenant="serving", secret=SECRET.encode()) as one:
            assert sum(one.contains([bytes(k) for k in fresh])) >= 1, "the restarted node takes blocks again"
        assert kv.lookup(sorted(on_second)[:1]) == 0, "what it lost stays lost: a miss, not wrong bytes"


def test_the_tenants_quota_holds_for_shared_blocks(tmp_path) -> None:
    quota = 4 * LAYOUT.block_bytes
    with running_node(tenants=tenants_yaml(tmp_path, quota), **NODE) as node:
        write_from_another_process(node.address, 8, "demoted")  # 8 blocks into a quota of 4
        with PoolClient([node.address], tenant="serving", secret=SECRET.encode()) as one:
            tenant = one.stats()[0]["tenant"]
            assert tenant["used_bytes"] <= tenant["quota_bytes"] == quota
            on_pool = one.contains([bytes(k) for k in KEYS])
        assert 1 <= sum(on_pool) <= 4  # the node evicted the tenant's own older blocks
        with KVTier(config_from_dict(config(node.address)), layout=LAYOUT) as kv:
            found = [k for k, hit in zip(KEYS, on_pool) if hit]
            assert kv.lookup(found[:1]) == 1
            got, failed = load(kv, found[:1])
            assert not failed and torch.equal(got[0], expected(found[0]))


def test_a_lookup_the_pool_refuses_is_a_miss_not_an_error(node, monkeypatch) -> None:
    """A node that refuses the tenant after start-up (its secret rotated): lookups miss, loudly."""
    from kvtier.pool.client.connection import AuthFailed

    write_from_another_process(node.address, 2, "pool")
    with KVTier(config_from_dict(config(node.address)), layout=LAYOUT) as kv:
        def refuse(keys):
            raise AuthFailed("pool node: the tenant's credentials were refused")

        monkeypatch.setattr(kv.tiers[P]._client, "contains", refuse)
        assert kv.lookup(KEYS[:2]) == 0 and kv.loadable(KEYS[:2]) == 0


def test_a_frozen_node_is_misses_within_the_timeout_then_serves_again(node) -> None:
    """SIGSTOP: the node holds its sockets and answers nothing. A lookup asks it again for the
    blocks only it serves here, gets no answer within the timeout, and forgets them: misses, not
    a hang and not a hit followed by a failed load. Once the node runs again they are found anew."""
    write_from_another_process(node.address, 3, "pool")
    # No negative cache: the misses while frozen would otherwise be remembered for a second.
    with KVTier(config_from_dict(config(node.address, timeout_s=0.5, negative_cache_s=0)), layout=LAYOUT) as kv:
        assert kv.lookup(KEYS[:3]) == 3
        node.pause()
        try:
            assert kv.lookup(KEYS[:3]) == 0
            assert kv.snapshot()["shared"]["forgotten"] == 3
            got, failed = load(kv, KEYS[:3])
            assert set(failed) == set(KEYS[:3])  # not indexed any more: misses, never bytes
        finally:
            node.resume()
        assert kv.lookup(KEYS[:3]) == 3
        got, failed = load(kv, KEYS[:3])
        assert not failed and all(torch.equal(r, expected(k)) for r, k in zip(got, KEYS[:3]))
