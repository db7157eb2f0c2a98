"""A hostile tenant sends MULTI_PUT frames built to hurt a real pool node: more entries than a frame
may hold, lengths that disagree with the payload, a key twice in one frame, a bad checksum amid good
entries, a frame cut off mid-payload, more than its quota, and keys another tenant stored. What must
hold: the node answers each with a clear status or error (closing only that connection where the
frame cannot be followed), commits no block partly or against the wrong checksum, hands no tenant
another's bytes, leaves nothing reserved or leased behind, and goes on serving another tenant.
Cost: about 2 s (one node start).
"""

from __future__ import annotations

import hashlib

import pytest

from kvtier.pool.buffers import block_checksum
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node
from kvtier.pool.protocol import MAX_BATCH, ErrorCode, GrantStatus, MsgType, encode
from support.pool import SECRETS, WAIT_S, Raw, wait_until

KIB = 1024
BLOCK = 4 * KIB


def data_for(key: bytes, n: int = BLOCK) -> bytes:
    return hashlib.shake_128(key).digest(n)


def header(keys, blocks, checksums=None, lengths=None) -> dict:
    return {"keys": list(keys), "lengths": lengths or [len(b) for b in blocks], "lease_s": 30,
            "checksums": checksums or [block_checksum(k, b) for k, b in zip(keys, blocks)]}


@pytest.fixture(scope="module")
def node(tenants_file):
    with running_node(capacity="2MiB", region_size="256KiB", tenants=tenants_file,
                      credentials=("alice", SECRETS["alice"])) as n:
        yield n


@pytest.fixture
def alice(node):
    with PoolClient([node.address], tenant="alice", secret=SECRETS["alice"], timeout_s=WAIT_S) as c:
        yield c


def bob(node) -> Raw:
    return Raw(node.address, "bob", SECRETS["bob"])


def assert_nothing_held_and_alice_served(alice: PoolClient, tag: bytes) -> None:
    """No reservation, lease or access is left behind (once the node has seen a cut connection
    close), and another tenant still puts and gets."""
    wait_until(lambda: (lambda f: f["accesses_in_flight"] == 0 and f["active_leases"] == 0)(alice.stats()[0]),
               "the node let go of every access and lease")
    key = b"alice-after-" + tag
    assert alice.batch_put([key], [data_for(key)]) == [True]
    out = bytearray(BLOCK)
    assert alice.get(key, out) and bytes(out) == data_for(key)


def expect_error_and_close(raw: Raw, code: ErrorCode) -> None:
    msg, reply, _ = raw.recv()
    assert msg is MsgType.ERROR and reply["code"] == code, reply
    assert raw.closed_by_peer()


def test_more_entries_than_a_frame_may_hold_is_malformed(node, alice):
    raw = bob(node)
    keys = [b"n%d" % i for i in range(MAX_BATCH + 1)]
    raw.send(MsgType.MULTI_PUT, header(keys, [b""] * len(keys), checksums=[0] * len(keys)))
    expect_error_and_close(raw, ErrorCode.MALFORMED)
    raw.close()
    assert_nothing_held_and_alice_served(alice, b"count")


@pytest.mark.parametrize("declared", [BLOCK * 3 + 1, BLOCK * 3 - 1, 0], ids=["more", "less", "zero"])
def test_lengths_that_disagree_with_the_payload_reserve_nothing(node, alice, declared):
    raw = bob(node)
    keys = [b"len-%d" % i for i in range(3)]
    blocks = [data_for(k) for k in keys]
    lengths = [BLOCK, BLOCK, declared - 2 * BLOCK] if declared >= 2 * BLOCK else [declared, 0, 0]
    raw.send(MsgType.MULTI_PUT, header(keys, blocks, lengths=lengths), b"".join(blocks))
    expect_error_and_close(raw, ErrorCode.MALFORMED)
    raw.close()
    check = bob(node)
    assert check.call(MsgType.CONTAINS, {"keys": keys})["found"] == [False] * 3
    check.close()
    assert_nothing_held_and_alice_served(alice, b"len-%d" % declared)


def test_a_key_twice_in_one_frame_stores_the_first_and_answers_the_second_busy(node, alice):
    raw = bob(node)
    first, second = data_for(b"dup-a"), data_for(b"dup-b")
    reply = raw.call(MsgType.MULTI_PUT, header([b"dup", b"dup"], [first, second]), first + second)
    assert reply["results"] == [[GrantStatus.GRANTED, True], [GrantStatus.BUSY, False]]
    hits = raw.call(MsgType.GET, {"keys": [b"dup"], "lease_s": 1, "release": [], "inline": True})["hits"]
    assert hits[0][0] and hits[0][5] == block_checksum(b"dup", first), "the first entry's bytes, not the second's"
    raw.close()
    assert_nothing_held_and_alice_served(alice, b"dup")


def test_a_bad_checksum_amid_a_batch_fails_that_entry_only(node, alice):
    keys = [b"mid-%d" % i for i in range(5)]
    blocks = [data_for(k) for k in keys]
    sums = [block_checksum(k, b) for k, b in zip(keys, blocks)]
    sums[2] = block_checksum(keys[1], blocks[1])  # another entry's checksum: valid, but not of these bytes
    raw = Raw(node.address, "alice", SECRETS["alice"])
    before = alice.stats()[0]["tenant"]["used_bytes"]
    reply = raw.call(MsgType.MULTI_PUT, header(keys, blocks, sums), b"".join(blocks))
    raw.close()
    assert [r[0] for r in reply["results"]] == [0, 0, GrantStatus.CHECKSUM, 0, 0]
    assert [r[1] for r in reply["results"]] == [True, True, False, True, True]
    out = [bytearray(BLOCK) for _ in keys]
    assert alice.batch_get(keys, out) == [True, True, False, True, True]
    assert [bytes(out[j]) for j in (0, 1, 3, 4)] == [blocks[j] for j in (0, 1, 3, 4)]
    facts = alice.stats()[0]
    assert facts["tenant"]["used_bytes"] - before == 4 * BLOCK, "the refused entry's slot is free again"
    assert facts["rejected_checksum"] >= 1
    assert_nothing_held_and_alice_served(alice, b"mid")


def test_a_frame_cut_off_mid_payload_commits_none_of_it(node, alice):
    check = bob(node)
    used = check.call(MsgType.STATS, {})["stats"]["used_bytes"]
    raw = bob(node)
    keys = [b"cut-%d" % i for i in range(4)]
    blocks = [data_for(k) for k in keys]
    payload = b"".join(blocks)
    raw.sock.sendall(encode(MsgType.MULTI_PUT, 1, header(keys, blocks), len(payload)) + payload[: 2 * BLOCK + 10])
    raw.close()  # two entries whole, the third begun: none commits, every slot goes back
    assert_nothing_held_and_alice_served(alice, b"cut")
    assert check.call(MsgType.CONTAINS, {"keys": keys})["found"] == [False] * 4
    assert check.call(MsgType.STATS, {})["stats"]["used_bytes"] == used
    check.close()


def test_past_its_quota_a_tenant_gets_quota_statuses_and_no_one_elses_memory(node, alice):
    """bob's quota is 128 KiB: a frame of 48 blocks of 4 KiB fills it (evicting bob's own blocks
    as it goes) and is refused QUOTA for the rest; alice's blocks are untouched."""
    mine = [b"alice-keep-%d" % i for i in range(4)]
    assert alice.batch_put(mine, [data_for(k) for k in mine]) == [True] * 4
    raw = bob(node)
    keys = [b"q-%d" % i for i in range(48)]
    blocks = [data_for(k) for k in keys]
    results = raw.call(MsgType.MULTI_PUT, header(keys, blocks), b"".join(blocks))["results"]
    statuses = {r[0] for r in results}
    assert statuses <= {GrantStatus.GRANTED, GrantStatus.QUOTA}, statuses
    assert GrantStatus.QUOTA in statuses and sum(r[1] for r in results) <= 128 * KIB // BLOCK
    assert raw.call(MsgType.STATS, {})["stats"]["used_bytes"] <= 128 * KIB
    raw.close()
    out = [bytearray(BLOCK) for _ in mine]
    assert alice.batch_get(mine, out) == [True] * 4
    assert [bytes(b) for b in out] == [data_for(k) for k in mine]
    assert_nothing_held_and_alice_served(alice, b"quota")


def test_keys_another_tenant_stored_are_a_separate_space(node, alice):
    """bob multi-puts under keys alice stored (other bytes): they are bob's own blocks; alice still
    reads hers, and bob reads back only what he wrote."""
    keys = [b"shared-%d" % i for i in range(3)]
    assert alice.batch_put(keys, [data_for(k) for k in keys]) == [True] * 3
    raw = bob(node)
    theirs = [data_for(b"bob's " + k) for k in keys]
    reply = raw.call(MsgType.MULTI_PUT, header(keys, theirs), b"".join(theirs))
    assert reply["results"] == [[GrantStatus.GRANTED, True]] * 3, "not EXISTS: alice's keys are not bob's"
    hits = raw.call(MsgType.GET, {"keys": keys, "lease_s": 1, "release": [], "inline": True})
    raw.close()
    assert [h[5] for h in hits["hits"]] == [block_checksum(k, b) for k, b in zip(keys, theirs)]
    out = [bytearray(BLOCK) for _ in keys]
    assert alice.batch_get(keys, out) == [True] * 3
    assert [bytes(b) for b in out] == [data_for(k) for k in keys]
    assert_nothing_held_and_alice_served(alice, b"space")


def test_a_payload_above_the_frame_limit_is_refused_before_it_is_read(node, alice):
    raw = bob(node)
    n = 256 * KIB + 1  # a region is the frame limit
    raw.sock.sendall(encode(MsgType.MULTI_PUT, 1, header([b"huge"], [b""], checksums=[0], lengths=[n]), n))
    expect_error_and_close(raw, ErrorCode.TOO_LARGE)
    raw.close()
    assert_nothing_held_and_alice_served(alice, b"huge")
