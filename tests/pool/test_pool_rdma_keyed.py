"""Keyed blocks over the RDMA data plane (fake verbs NIC, real `kvtier pool serve --transport rdma`):
the node never sees a one-sided WRITE, so it commits a put only once the bytes that landed match
the writer's key-seeded checksum; a put whose bytes did not all land is refused, never served.
Cost: about 2 s.
"""

from __future__ import annotations

import os

import pytest

from kvtier.pool.buffers import block_checksum
from kvtier.pool.client.api import PoolClient
from kvtier.pool.detect import TransportKind
from kvtier.pool.protocol import GrantStatus, MsgType
from kvtier.testing.pool import rdma_node

BLOCK = 40_000


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    with rdma_node("fake", tmp_path_factory.mktemp("fabric"), capacity="8MiB", region_size="256KiB") as n:
        yield n


def test_keyed_puts_and_gets_over_rdma(node):
    keys = [os.urandom(16) for _ in range(6)]
    blocks = [os.urandom(BLOCK) for _ in keys]
    with PoolClient([node.address], timeout_s=30, transport=TransportKind.RDMA, verbs=node.verbs) as client:
        assert client.transports[0].name == "rdma"
        assert client.batch_put(keys, blocks) == [True] * 6
        out = [bytearray(BLOCK) for _ in keys]
        assert client.batch_get(keys, out) == [True] * 6
        assert [bytes(o) for o in out] == blocks
        assert client.contains(keys) == [True] * 6


def test_a_commit_whose_bytes_did_not_land_is_refused(node):
    key = os.urandom(16)
    with PoolClient([node.address], timeout_s=30, transport=TransportKind.RDMA, verbs=node.verbs) as client:
        link = client.links[0]
        grant = link.call(MsgType.PUT_BEGIN, {"keys": [key], "lengths": [BLOCK], "lease_s": 30.0})["grants"][0]
        assert grant[0] == GrantStatus.GRANTED
        # No WRITE at all: the slot holds zeros, which the writer's checksum does not describe.
        ok = link.call(MsgType.PUT_COMMIT, {"keys": [key], "gens": [grant[3]],
                                            "checksums": [block_checksum(key, os.urandom(BLOCK))]})["ok"]
        assert ok == [False]
        assert client.contains([key]) == [False], "never visible"
