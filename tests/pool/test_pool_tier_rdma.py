"""The runtime's pool tier on the RDMA data plane: `transport: rdma` moves blocks through
`RDMATransport` over the fake verbs NIC (`verbs: kvtier.testing.fake_verbs`, the node a real `kvtier pool serve
--transport rdma` subprocess on the same fake fabric), and `transport: auto` reports what it chose
and why. Cost: about 4 s (two node starts).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvtier.config import KVTierConfig, config_from_dict
from kvtier.errors import ConfigError
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node
from kvtier.testing.pool import FAKE_VERBS
from kvtier.pool.client.rdma import RDMATransport
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.pool import store_each
from support.runtime import BLOCK, LAYOUT, WAIT_S, blocks

P = TierKind.POOL


@pytest.fixture
def fabric(tmp_path, monkeypatch):
    """A fake RDMA fabric this process and the nodes it starts share (the fake's env is inherited)."""
    monkeypatch.setenv("KVTIER_FAKE_FABRIC", str(tmp_path / "fabric"))
    (tmp_path / "fabric").mkdir()


def config(tmp_path, node_address: str, transport: str) -> KVTierConfig:
    return config_from_dict({
        "model": "kvtier-tiny",
        "tiers": {
            "hbm": {"capacity": 2 * BLOCK, "device": "cpu", "high_watermark": 1.0, "low_watermark": 1.0},
            "dram": {"capacity": 2 * BLOCK, "high_watermark": 1.0, "low_watermark": 1.0},
            "pool": {"capacity": 4 * BLOCK, "nodes": [node_address], "transport": transport,
                     "verbs": FAKE_VERBS, "timeout_s": WAIT_S, "reconnect_s": 0, "high_watermark": 1.0, "low_watermark": 1.0},
        },
    })


def pool_facts(kv: KVTier) -> dict:
    return next(t for t in kv.describe()["tiers"] if t["tier"] == "pool")


def node_bytes(address: str) -> tuple[int, int]:
    """Bytes the node moved itself (TCP data plane); one-sided RDMA never shows here."""
    with PoolClient([address], timeout_s=WAIT_S) as c:
        facts = c.stats()[0]
    return facts["bytes_in"], facts["bytes_out"]


def test_transport_rdma_stores_and_loads_through_one_sided_verbs(tmp_path, fabric):
    with running_node(capacity="4MiB", region_size="256KiB", extra=["--transport", "rdma", "--verbs", FAKE_VERBS]) as node:
        with KVTier(config(tmp_path, node.address, "rdma"), layout=LAYOUT) as kv:
            facts = pool_facts(kv)
            assert facts["transport"] == "rdma" and "requested" in facts["transport_reason"], facts
            assert all(isinstance(t, RDMATransport) for t in kv.tiers[P]._client.transports)
            store_each(kv, range(8))
            where = kv.where(range(8))
            pool_keys = [k for k, w in zip(range(8), where) if w is P]
            assert len(pool_keys) == 4, where
            out = torch.zeros(len(pool_keys), BLOCK, dtype=torch.uint8)
            handle = kv.load(pool_keys, out)
            assert handle.wait(WAIT_S) and handle.failed == {}
            assert torch.equal(out, blocks(pool_keys)), "byte-identical through RDMA READ"
            assert kv.snapshot()["hits"]["pool"] == len(pool_keys)
            assert node_bytes(node.address) == (0, 0), "the node's CPU moved none of the blocks' bytes"
            # Zero copy: between a DRAM slot and the pool the NIC used the registered DRAM slab
            # itself; every other route to or from the pool (the caller's buffers, the HBM
            # stand-in) went through the staging buffer.
            transport, moved = kv.tiers[P]._client.transports[0], kv.snapshot()["bytes_moved"]
            via_dram = moved.get("dram->pool", 0) + moved.get("pool->dram", 0)
            assert via_dram > 0 and transport.zero_copy_bytes == via_dram, (transport.zero_copy_bytes, moved)
            other = sum(n for route, n in moved.items() if "pool" in route) - via_dram
            assert transport.staged_bytes == other, (transport.staged_bytes, moved)
            assert transport.zero_copy_error is None
            facts = pool_facts(kv)
            assert (facts["rdma_zero_copy"], facts["rdma_zero_copy_bytes"]) == ("on", via_dram), facts


def test_transport_auto_against_a_tcp_only_node_reports_tcp_and_why(tmp_path, fabric):
    with running_node(capacity="4MiB", region_size="256KiB", extra=["--transport", "tcp"]) as node:
        with KVTier(config(tmp_path, node.address, "auto"), layout=LAYOUT) as kv:
            facts = pool_facts(kv)
            assert (facts["transport"], facts["transport_reason"]) == ("tcp", "auto: node serves tcp only")
            store_each(kv, range(8))
            assert kv.where(range(8)).count(P) == 4
            assert node_bytes(node.address)[0] >= 4 * BLOCK, "the bytes went over TCP"


def test_transport_auto_against_an_rdma_node_takes_rdma(tmp_path, fabric):
    with running_node(capacity="4MiB", region_size="256KiB", extra=["--transport", "rdma", "--verbs", FAKE_VERBS]) as node:
        with KVTier(config(tmp_path, node.address, "auto"), layout=LAYOUT) as kv:
            facts = pool_facts(kv)
            assert facts["transport"] == "rdma" and "node serves rdma" in facts["transport_reason"], facts


def test_transport_rdma_against_a_tcp_only_node_is_a_config_error(tmp_path, fabric):
    with running_node(capacity="4MiB", region_size="256KiB", extra=["--transport", "tcp"]) as node:
        with pytest.raises(ConfigError, match=r"tiers\.pool\.transport: rdma, but node .* serves tcp"):
            KVTier(config(tmp_path, node.address, "rdma"), layout=LAYOUT)


def test_transport_rdma_without_a_device_here_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.delenv("KVTIER_FAKE_FABRIC", raising=False)  # the fake NIC is absent
    with pytest.raises(ConfigError, match=r"tiers\.pool: transport rdma: no RDMA device"):
        KVTier(config(tmp_path, "127.0.0.1:1", "rdma"), layout=LAYOUT)


def test_shared_blocks_move_by_key_over_rdma_whole_and_layer_by_layer(tmp_path, fabric):
    """BlockKeys on the RDMA data plane: a put of header and block as two one-sided WRITEs (no
    copy to join them), a whole-block load, and a load read layer by layer (chunk_bytes 0: the
    streamed get's parts read one-sided under one lease); the node's CPU moves none of it."""
    from kvtier.model.keys import Namespace, block_keys

    keys = block_keys(Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens),
                      list(range(3 * LAYOUT.block_tokens)))
    rows = torch.stack([blocks([i])[0] for i in range(3)])
    with running_node(capacity="4MiB", region_size="256KiB", extra=["--transport", "rdma", "--verbs", FAKE_VERBS]) as node:
        with KVTier(config(tmp_path, node.address, "rdma"), layout=LAYOUT) as writer:
            handle = writer.store(keys, rows, target=P)
            assert handle.wait(WAIT_S) and not handle.failed
        for chunk_bytes in (1 << 20, 0):
            cfg = config(tmp_path, node.address, "rdma")
            cfg = replace(cfg, transfer=replace(cfg.transfer, chunk_bytes=chunk_bytes))
            with KVTier(cfg, layout=LAYOUT) as reader:
                assert reader.lookup(keys) == 3
                out = torch.zeros_like(rows)
                assert reader.load(keys, out).wait(WAIT_S) and torch.equal(out, rows)
                assert reader.snapshot()["pool_client"]["hits"] == 3
        assert node_bytes(node.address) == (0, 0)
