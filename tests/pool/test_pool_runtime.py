"""The runtime with all four tiers — CPU stand-in HBM, DRAM, a pool node subprocess, SSD files —
storing and loading through the pool; the pool section of the YAML config; a pool node lost under
the runtime. Cost: about 12 s on 2 cores (mostly node starts and the runtime's SSD files).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.config import KVTierConfig, TierConfig, config_from_dict
from kvtier.errors import ConfigError
from kvtier.pool.client.api import PoolClient
from kvtier.pool.detect import TransportKind
from kvtier.pool.node.process import NodeProcess, running_node
from kvtier.pool.client.tier import PoolTier
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.runtime import BLOCK, LAYOUT, WAIT_S, blocks

H, D, P, S = TierKind.HBM, TierKind.DRAM, TierKind.POOL, TierKind.SSD
SECRET = "runtime-secret-123456"


@pytest.fixture
def tenants(tmp_path):
    path = tmp_path / "tenants.yaml"
    path.write_text(f"tenants:\n  - {{name: serving, secret: {SECRET}}}\n")
    return path


@pytest.fixture
def node(tenants):
    with running_node(capacity="4MiB", region_size="256KiB", tenants=tenants,
                      credentials=("serving", SECRET.encode())) as n:
        yield n


def config(tmp_path, node_address: str, secret: str = SECRET) -> KVTierConfig:
    return config_from_dict({
        "model": "kvtier-tiny",
        "tiers": {
            "hbm": {"capacity": 2 * BLOCK, "device": "cpu", "high_watermark": 1.0, "low_watermark": 1.0},
            "dram": {"capacity": 2 * BLOCK, "high_watermark": 1.0, "low_watermark": 1.0},
            "pool": {"capacity": 4 * BLOCK, "nodes": [node_address], "tenant": "serving", "secret": secret,
                     "timeout_s": WAIT_S, "reconnect_s": 0, "high_watermark": 1.0, "low_watermark": 1.0},
            "ssd": {"capacity": 8 * BLOCK, "path": str(tmp_path / "ssd"), "high_watermark": 1.0,
                    "low_watermark": 1.0},
        },
    })


from support.pool import store_each




def load(kv: KVTier, keys):
    out = torch.zeros(len(keys), BLOCK, dtype=torch.uint8)
    handle = kv.load(keys, out)
    handle.wait(WAIT_S)  # False when some block failed: the caller looks at handle.failed
    return out, handle


def test_blocks_cascade_through_the_pool_and_come_back_identical(tmp_path, node):
    with KVTier(config(tmp_path, node.address), layout=LAYOUT) as kv:
        assert isinstance(kv.tiers[P], PoolTier) and kv.tiers[P].num_slots == 4
        assert [t["tier"] for t in kv.describe()["tiers"]] == ["hbm", "dram", "pool", "ssd"]
        store_each(kv, range(8))
        where = kv.where(range(8))
        assert set(where) == {H, D, P} and where.count(P) == 4, where
        pool_keys = [k for k, w in zip(range(8), where) if w is P]
        out, handle = load(kv, pool_keys)
        assert handle.failed == {} and torch.equal(out, blocks(pool_keys))
        assert kv.snapshot()["hits"]["pool"] == len(pool_keys)
        store_each(kv, range(8, 10))  # the promotions pushed blocks on through the pool into the SSD
        assert S in kv.where(range(10))
        out, handle = load(kv, list(range(10)))
        assert handle.failed == {} and torch.equal(out, blocks(range(10)))
    with PoolClient([node.address], tenant="serving", secret=SECRET.encode(), timeout_s=WAIT_S) as c:
        facts = c.stats()[0]
    assert facts["bytes_in"] >= 4 * BLOCK and facts["bytes_out"] >= 4 * BLOCK
    assert facts["num_blocks"] == 0, "closing the runtime frees its pool slots"


def test_a_lost_pool_node_turns_its_blocks_into_misses_and_the_rest_keeps_serving(tmp_path, tenants):
    node = NodeProcess(capacity="4MiB", region_size="256KiB", tenants=tenants,
                       credentials=("serving", SECRET.encode()))
    try:
        with KVTier(config(tmp_path, node.address), layout=LAYOUT) as kv:
            keys = list(range(8))
            store_each(kv, keys)
            where = kv.where(keys)
            assert where.count(P) == 4
            node.kill()
            # A block demoted into the pool also went to the SSD (the node evicts by its own
            # recency, so it is never a block's only home while a tier below has room): the load
            # that finds the node dead reads those blocks from their SSD copies (issue 29).
            out, handle = load(kv, keys)
            lost = {k for k, w in zip(keys, where) if w is P}
            assert lost and handle.failed == {} and torch.equal(out, blocks(keys)), "the dead node cost no block"
            assert kv.stats.fallback_reads[S] == len(lost), "the pool's blocks came from the SSD"
            assert "pool" in kv.snapshot()["unavailable"], "the pool is out of the cascade"
            assert kv.lookup(sorted(lost)) == len(lost), "and are still served from there"
            out, handle = load(kv, sorted(lost))
            assert handle.failed == {} and torch.equal(out, blocks(sorted(lost)))
            assert kv.recheck() == [], "a probe finds it still down"
            node.start()  # the node comes back empty; the tier stores through it again
            kv.recheck()  # or the background prober got there first
            assert kv.snapshot()["unavailable"] == {} and kv.stats.tier_recoveries[P] == 1
            fresh = list(range(100, 108))
            store_each(kv, fresh)
            out, handle = load(kv, fresh)
            assert handle.failed == {} and torch.equal(out, blocks(fresh))
        with PoolClient([node.address], tenant="serving", secret=SECRET.encode(), timeout_s=WAIT_S) as c:
            assert c.stats()[0]["bytes_in"] >= BLOCK, "the restarted node took blocks again"
    finally:
        node.close()


def test_a_wrong_secret_is_a_config_error_naming_the_tier(tmp_path, node):
    with pytest.raises(ConfigError, match=r"tiers\.pool: .*authentication failed"):
        KVTier(config(tmp_path, node.address, secret="not-the-secret"), layout=LAYOUT)


def test_an_unreachable_node_at_start_is_only_a_warning(tmp_path, caplog):
    cfg = config(tmp_path, "127.0.0.1:1")
    with KVTier(cfg, layout=LAYOUT) as kv:
        assert "unreachable" in caplog.text
        _, handle = load(kv, [1])
        assert set(handle.failed) == {1}


@pytest.mark.parametrize("section,message", [
    ({"capacity": "1MiB"}, r"tiers\.pool\.nodes"),
    ({"capacity": "1MiB", "nodes": ["nohost"]}, r"tiers\.pool\.nodes\[0\]"),
    ({"capacity": "1MiB", "nodes": ["a:1", "a:1"]}, r"tiers\.pool\.nodes"),
    ({"capacity": "1MiB", "nodes": ["a:1"], "timeout_s": 0}, r"tiers\.pool\.timeout_s"),
    ({"capacity": "1MiB", "nodes": ["a:1"], "transport": "carrier-pigeon"}, r"tiers\.pool\.transport"),
    ({"capacity": "1MiB", "nodes": ["a:1"], "secret": "x", "secret_file": "/f"}, r"tiers\.pool\.secret"),
    ({"capacity": "1MiB", "nodes": ["a:1"], "tenant": ""}, r"tiers\.pool\.tenant"),
    ({"capacity": "1MiB", "nodes": ["a:1"], "path": "/x"}, r"tiers\.pool\.path"),
])
def test_pool_config_errors_name_the_field(section, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB"}, "pool": section}})


def test_pool_fields_are_refused_on_other_tiers_and_defaults_hold():
    with pytest.raises(ConfigError, match=r"tiers\.dram\.nodes"):
        config_from_dict({"model": "kvtier-tiny", "tiers": {"dram": {"capacity": "1MiB", "nodes": ["a:1"]}}})
    cfg = config_from_dict({"model": "kvtier-tiny", "tiers": {"pool": {"capacity": "1MiB", "nodes": "h:7"}}})
    pool = cfg.tier(P)
    assert (pool.nodes, pool.tenant, pool.timeout_s, pool.transport) == (("h:7",), "default", 2.0, TransportKind.AUTO)
    assert "hush" not in repr(TierConfig(P, 1, secret="hush")), "a secret never prints"
