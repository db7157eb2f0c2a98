"""MULTI_PUT: a batch's inline puts to one node in one frame, one reply with a status per entry.

The schema and the payload check sans-I/O; then an in-process `PoolNode` (TCP, 127.0.0.1) reached
by a real `PoolClient` and by raw frames: a round trip of a batch, statuses per entry (stored,
stored already, busy, too large, bad checksum), one frame per node per batch, and the fallback to
one PUT per block against a node that does not know the message (an older node: here one whose
MULTI_PUT handler is taken away, so it answers MALFORMED as an older one does). Cost: about 1 s.
"""

from __future__ import annotations

import hashlib
import logging

import pytest

from kvtier.pool.buffers import block_checksum
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.node_calls import _frames_within
from kvtier.pool.node.config import NodeConfig
from kvtier.pool.node.server import PoolNode
from kvtier.pool.protocol import (REPLIES, REQUESTS, GrantStatus, MsgType, ProtocolError, check_header,
                                  check_multi_put, encode, FrameDecoder)
from kvtier.pool.tenants import open_tenants
from support.pool import WAIT_S, Raw

KIB, MIB = 1024, 1 << 20


def data_for(key: bytes, n: int) -> bytes:
    return hashlib.shake_128(key).digest(n)


def start_node(capacity_bytes: int = 8 * MIB, region_bytes: int = 2 * MIB) -> PoolNode:
    node = PoolNode(NodeConfig("127.0.0.1", 0, capacity_bytes, open_tenants(capacity_bytes),
                               region_bytes=region_bytes))
    node.start()
    return node


@pytest.fixture
def node():
    n = start_node()
    yield n
    n.stop()


def address(node: PoolNode) -> str:
    host, port = node.address
    return f"{host}:{port}"


def multi_put_header(keys, blocks, checksums=None) -> dict:
    return {"keys": keys, "lengths": [len(b) for b in blocks], "lease_s": 30,
            "checksums": checksums or [block_checksum(k, b) for k, b in zip(keys, blocks)]}


# ---- sans-I/O ------------------------------------------------------------------------------

def test_the_request_and_reply_schemas_round_trip_through_the_decoder():
    header = multi_put_header([b"k1", b"k2"], [b"ab", b"cde"])
    dec = FrameDecoder(reply=False, max_payload=1 << 20)
    dec.feed(encode(MsgType.MULTI_PUT, 7, header, 5) + b"abcde")
    frame = dec.next_frame()
    assert (frame.type, frame.request_id, frame.header, frame.payload) == (MsgType.MULTI_PUT, 7, header, b"abcde")
    check_multi_put(frame.header, len(frame.payload))
    assert check_header(MsgType.MULTI_PUT, {"results": [[0, True], [7, False]]}, REPLIES)


@pytest.mark.parametrize("change", [{"lengths": [1]}, {"checksums": [1, 2, 3]}, {"keys": [b""] * 2}])
def test_unequal_lists_or_bad_keys_are_malformed(change):
    header = {**multi_put_header([b"k1", b"k2"], [b"ab", b"cde"]), **change}
    with pytest.raises(ProtocolError, match="MULTI_PUT"):
        check_header(MsgType.MULTI_PUT, header, REQUESTS)


def test_lengths_that_disagree_with_the_payload_are_malformed():
    header = multi_put_header([b"k1", b"k2"], [b"ab", b"cde"])
    with pytest.raises(ProtocolError, match="MULTI_PUT.lengths: entries of 5 bytes in all, payload of 4"):
        check_multi_put(header, 4)


def test_frames_are_cut_at_the_node_limit_and_a_block_above_it_is_in_none():
    assert _frames_within([4, 4, 4], 12) == [[0, 1, 2]]
    assert _frames_within([4, 4, 4], 8) == [[0, 1], [2]]
    assert _frames_within([4, 20, 4], 8) == [[0, 2]]
    assert _frames_within([], 8) == []


# ---- a live node ---------------------------------------------------------------------------

def test_a_batch_is_one_frame_and_reads_back(node):
    keys = [b"rt-%d" % i for i in range(16)]
    blocks = [data_for(k, 64 * KIB) for k in keys]
    with PoolClient([address(node)], timeout_s=WAIT_S) as c:
        assert c.batch_put(keys, blocks) == [True] * 16
        counters = c.counters
        out = [bytearray(64 * KIB) for _ in keys]
        assert c.batch_get(keys, out) == [True] * 16
    assert [bytes(b) for b in out] == blocks
    # one frame for the 16 blocks (the probe, an empty MULTI_PUT, rode in the handshake)
    assert counters["put_frames"] == 1 and counters["node_calls"] == 1 and counters["puts"] == 16
    assert node.stats()["puts"] == 16


def test_a_block_given_as_several_buffers_is_stored_as_their_concatenation(node):
    with PoolClient([address(node)], timeout_s=WAIT_S) as c:
        assert c.batch_put([b"parts"], [(b"head", b"tail-bytes")]) == [True]
        out = bytearray(14)
        assert c.get(b"parts", out) and bytes(out) == b"headtail-bytes"


def test_each_entry_gets_its_own_status(node):
    raw = Raw(address(node))
    stored = data_for(b"st-old", 1000)
    assert raw.call(MsgType.MULTI_PUT, multi_put_header([b"st-old"], [stored]), stored)["results"] == [[0, True]]
    keys = [b"st-new", b"st-old", b"st-bad", b"st-dup", b"st-dup"]
    blocks = [data_for(k, 1000) for k in keys]
    sums = [block_checksum(k, b) for k, b in zip(keys, blocks)]
    sums[2] ^= 1
    reply = raw.call(MsgType.MULTI_PUT, multi_put_header(keys, blocks, sums), b"".join(blocks))
    assert reply["results"] == [[GrantStatus.GRANTED, True], [GrantStatus.EXISTS, False],
                                [GrantStatus.CHECKSUM, False], [GrantStatus.GRANTED, True],
                                [GrantStatus.BUSY, False]]
    found = raw.call(MsgType.CONTAINS, {"keys": keys})["found"]
    assert found == [True, True, False, True, True]
    stats = node.stats()
    assert stats["rejected_checksum"] == 1 and stats["duplicate_put_bytes"] == 1000
    assert stats["accesses_in_flight"] == 0 and stats["active_leases"] == 0
    raw.close()


def test_statuses_reach_the_caller_and_a_block_above_a_region_is_too_large(node):
    with PoolClient([address(node)], timeout_s=WAIT_S) as c:
        assert c.put(b"tl-x", b"x" * 100)
        got = c.batch_put_status([b"tl-x", b"tl-big", b"tl-y"], [b"x" * 100, b"b" * (2 * MIB + 1), b"y" * 100])
        assert got == [GrantStatus.EXISTS, GrantStatus.TOO_LARGE, GrantStatus.GRANTED]
        assert c.counters["put_rejected_too_large"] == 1 and c.counters["put_exists"] == 1


def test_a_batch_above_the_frame_limit_goes_in_frames_of_at_most_a_region(node):
    keys = [b"big-%d" % i for i in range(5)]
    with PoolClient([address(node)], timeout_s=WAIT_S) as c:
        assert c.batch_put(keys, [data_for(k, MIB) for k in keys]) == [True] * 5
        assert c.counters["put_frames"] == 3 and c.counters["node_calls"] == 1


def test_a_node_that_does_not_know_the_message_gets_one_put_per_block(caplog):
    old = start_node()
    old._data.pop(MsgType.MULTI_PUT)  # what a node from before MULTI_PUT serves
    try:
        keys = [b"old-%d" % i for i in range(4)]
        blocks = [data_for(k, 4 * KIB) for k in keys]
        with caplog.at_level(logging.WARNING, "kvtier.pool.client.api"), \
                PoolClient([address(old)], timeout_s=WAIT_S) as c:
            assert c.batch_put(keys, blocks) == [True] * 4
            assert c.batch_put([b"old-more"], [b"z" * 10]) == [True]
            out = [bytearray(4 * KIB) for _ in keys]
            assert c.batch_get(keys, out) == [True] * 4 and [bytes(b) for b in out] == blocks
            assert c.counters["put_frames"] == 5 and not c.links[0].down
        said = [r for r in caplog.records if "does not know MULTI_PUT" in r.getMessage()]
        assert len(said) == 1  # once, not per batch
        assert old.stats()["protocol_errors"] == 1  # the probe's, once
    finally:
        old.stop()
