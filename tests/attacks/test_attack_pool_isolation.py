"""A hostile tenant of a real pool node tries to read another tenant's bytes: from memory handed
over after a delete or an eviction, through a commit of a block it wrote only a part of, through an
rkey learned before the region changed hands (RDMA, on the fake NIC), and a block misplaced under
another key tries to pass the client's check. What must hold: no tenant reads a byte its tenant did
not write into that block, and bytes under the wrong key are a miss. Cost: about 5 s (three node starts).
"""

from __future__ import annotations

import os

import pytest

from kvtier.pool.client.api import PoolClient
from kvtier.pool.detect import TransportKind
from kvtier.pool.protocol import MsgType
from kvtier.pool.node.process import running_node
from kvtier.testing.pool import rdma_node
from support.pool import SECRETS, WAIT_S, Raw

KIB = 1024
BLOCK = 64 * KIB
SECRET_BYTES = b"alice's KV " * (BLOCK // 11) + b"!" * (BLOCK % 11)


@pytest.fixture(scope="module")
def node_with_old_bytes():
    """An open node of one region whose four 64 KiB slots held blocks, since deleted."""
    with running_node(capacity="256KiB", region_size="256KiB") as node:
        with PoolClient([node.address], timeout_s=WAIT_S) as c:
            keys = [b"old-%d" % i for i in range(4)]
            assert c.batch_put(keys, [SECRET_BYTES] * 4) == [True] * 4
            assert c.delete(keys) == 4
        yield node


def read_mutable(raw: Raw, key: bytes) -> bytes:
    """ALLOCs a mutable block (READY and readable at once) and READs it whole, untouched."""
    status, region, offset, gen, _ = raw.call(MsgType.ALLOC, {"keys": [key], "lengths": [BLOCK]})["grants"][0]
    assert status == 0
    raw.send(MsgType.READ, {"region": region, "offset": offset, "length": BLOCK, "gen": gen})
    msg, _, n = raw.recv()
    assert msg is MsgType.READ and n == BLOCK
    out = bytearray(BLOCK)
    raw.frames.recv_into(memoryview(out))
    return bytes(out)


def test_memory_handed_to_another_tenant_holds_none_of_the_last_ones_bytes(tenants_file):
    """One region of 256 KiB: alice fills it and deletes her blocks, then fills it again and it is
    evicted for bob (quota permitting): each time bob's freshly allocated block reads as zeros."""
    with running_node(capacity="256KiB", region_size="256KiB", tenants=tenants_file,
                      credentials=("alice", SECRETS["alice"])) as node, \
            PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S) as alice:
        bob = Raw(node.address, "bob", SECRETS["bob"])
        keys = [b"a%d" % i for i in range(4)]
        assert alice.batch_put(keys, [SECRET_BYTES] * 4) == [True] * 4
        assert alice.delete(keys) == 4  # the region is free again, alice's bytes still in it
        assert read_mutable(bob, b"bob-1") == bytes(BLOCK), "after a delete"
        bob.call(MsgType.DELETE, {"keys": [b"bob-1"]})
        assert alice.batch_put(keys, [SECRET_BYTES] * 4) == [True] * 4  # alice's again (bob's zeros only)
        assert read_mutable(bob, b"bob-2") == bytes(BLOCK), "after an eviction"
        facts = alice.stats()[0]
        assert facts["region_handovers"] == 3 and facts["scrubbed_bytes"] >= 4 * BLOCK
        bob.close()


def test_a_commit_of_a_block_written_only_in_part_is_refused(node_with_old_bytes):
    """16 WRITEs of the same 4 KiB add up to 64 KiB but cover a sixteenth of the block: the commit
    is refused, so the rest of the slot (older bytes) is never readable under the key."""
    raw = Raw(node_with_old_bytes.address)
    grant = raw.call(MsgType.PUT_BEGIN, {"keys": [b"partial"], "lengths": [BLOCK], "lease_s": 30})["grants"][0]
    status, region, offset, gen, _ = grant
    assert status == 0
    for _ in range(16):
        assert raw.call(MsgType.WRITE, {"region": region, "offset": offset, "gen": gen}, b"w" * 4 * KIB) == {}
    ok = raw.call(MsgType.PUT_COMMIT, {"keys": [b"partial"], "gens": [gen], "checksums": [0]})["ok"]
    assert ok == [False]
    hits = raw.call(MsgType.GET, {"keys": [b"partial"], "lease_s": 1, "release": [], "inline": True})["hits"]
    assert hits[0][0] is False, "never readable"
    raw.close()


def test_a_block_that_lands_under_another_key_is_a_miss(node_with_old_bytes):
    """The node's index is made to point one key at another key's bytes and checksum (stored raw,
    as a mapping bug or a misdirected write would leave them): the client's check, seeded with the
    key it asked for, refuses them."""
    address = node_with_old_bytes.address
    data = os.urandom(BLOCK)
    with PoolClient([address], timeout_s=WAIT_S) as c:
        assert c.put(b"right-key", data)
        raw = Raw(address)
        (hit,) = raw.call(MsgType.GET, {"keys": [b"right-key"], "lease_s": 1, "release": [], "inline": False})["hits"]
        reply = raw.call(MsgType.PUT, {"key": b"wrong-key", "lease_s": 30, "checksum": hit[5]}, data)
        assert reply["stored"], "the node keeps what it is given"
        raw.close()
        buf = bytearray(BLOCK)
        assert c.get(b"wrong-key", buf) is False and c.counters["checksum_errors"] == 1
        assert c.get(b"right-key", buf) and buf == data


def test_an_rkey_learned_before_a_region_changed_hands_reaches_nothing_after(tmp_path, tenants_file):
    """Over RDMA a tenant's rkey covers its whole region. Alice learns region 0's rkey and frees
    her slot; the region passes to bob, who writes into it. Alice's old rkey must be dead (the NIC
    refuses it: a miss), and her next access reconnects and works in a region of her own."""
    with rdma_node("fake", tmp_path, capacity="512KiB", region_size="256KiB", tenants=tenants_file,
                   credentials=("alice", SECRETS["alice"])) as node, \
            PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S,
                       transport=TransportKind.RDMA, verbs=node.verbs) as alice, \
            PoolClient([node.address], tenant="bob", secret=SECRETS["bob"], timeout_s=WAIT_S,
                       transport=TransportKind.RDMA, verbs=node.verbs) as bob:
        mine = alice.alloc(b"alice-slot", BLOCK)
        assert alice.write_at(mine, 0, SECRET_BYTES) and alice.read_at(mine, 0, bytearray(BLOCK))
        alice.free([mine])
        theirs = bob.alloc(b"bob-slot", BLOCK)
        assert theirs.location.region == mine.location.region, "the region alice learned changed hands"
        assert bob.write_at(theirs, 0, b"bob's KV!" * (BLOCK // 9) + b"." * (BLOCK % 9))
        buf = bytearray(BLOCK)
        assert alice.read_at(mine, 0, buf) is False, "the old rkey is dead: a miss"
        assert b"bob" not in buf and buf == bytes(BLOCK)
        again = alice.alloc(b"alice-slot-2", BLOCK)
        assert alice.write_at(again, 0, SECRET_BYTES) and alice.read_at(again, 0, buf) and buf == SECRET_BYTES
        assert alice.stats()[0]["region_handovers"] >= 1

