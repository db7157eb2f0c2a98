"""How stores reach a shared pool tier, and how lookups combine it with this process's own tiers.

- A block the pool can share (a `BlockKey`) is written through to it on every store, in exclusive
  mode too, so that another process finds it at once; other keys reach the pool only as demoted.
- A lookup asks the pool only for the keys this process does not index, and counts a local block
  that follows the pool's run.
- Two writers of one block at once: the second waits for the first instead of failing.

Two `KVTier`s in one process stand for two processes here: each has its own pool client, index
and slots, and the node cannot tell them apart from two processes (the cross-process tests are in
test_pool_shared.py). Cost: one node subprocess for the module.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.config import config_from_dict
from kvtier.model.keys import Namespace, block_keys
from kvtier.pool.buffers import block_checksum
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import running_node
from kvtier.pool.protocol import GrantStatus, MsgType
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from support.pool import Raw
from support.runtime import LAYOUT, WAIT_S

D, P = TierKind.DRAM, TierKind.POOL
NAMESPACE = Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens)
SALTS = iter(range(1, 1 << 30))


def fresh_keys(n: int) -> list:
    """Keys no other test of the module stored (the node is shared by the module)."""
    return block_keys(NAMESPACE, [next(SALTS) for _ in range(n * LAYOUT.block_tokens)])


def data(keys) -> torch.Tensor:
    return torch.stack([torch.full((LAYOUT.block_bytes,), hash(bytes(k) if isinstance(k, bytes) else k) % 251,
                                   dtype=torch.uint8) for k in keys])


@pytest.fixture(scope="module")
def node():
    with running_node(capacity="4MiB", region_size="256KiB") as n:
        yield n


def runtime(address: str, timeout_s: float = WAIT_S, **pool) -> KVTier:
    return KVTier(config_from_dict({"model": "kvtier-tiny", "tiers": {
        "dram": {"capacity": 8 * LAYOUT.block_bytes, "high_watermark": 1.0, "low_watermark": 1.0},
        "pool": {"capacity": 16 * LAYOUT.block_bytes, "nodes": [address], "timeout_s": timeout_s,
                 "reconnect_s": 0, "high_watermark": 1.0, "low_watermark": 1.0, **pool}}}), layout=LAYOUT)


def store(kv: KVTier, keys, rows, target=None) -> None:
    handle = kv.store(keys, rows, target=target)
    assert handle.wait(WAIT_S) and not handle.failed, handle.failed
    kv.quiesce(WAIT_S)


def test_a_shared_block_is_written_through_to_the_pool_and_found_elsewhere_at_once(node):
    keys = fresh_keys(3)
    rows = data(keys)
    with runtime(node.address) as a, runtime(node.address) as b:
        store(a, keys, rows)
        assert a.where(keys) == [D] * 3  # served from DRAM, with a copy on the pool
        assert a.snapshot()["stores"] == {"dram": 3, "pool": 3}
        assert b.lookup(keys) == 3
        out = torch.zeros_like(rows)
        assert b.load(keys, out).wait(WAIT_S) and torch.equal(out, rows)
        own = ["private-1", 2]  # keys the pool cannot share: DRAM only, nothing written through
        store(a, own, data(own))
        assert a.snapshot()["stores"] == {"dram": 5, "pool": 3}


def test_write_through_off_leaves_the_pool_to_demotions(node):
    keys = fresh_keys(2)
    with runtime(node.address, write_through=False) as a, runtime(node.address) as b:
        store(a, keys, data(keys))
        assert a.snapshot()["stores"] == {"dram": 2}
        assert b.lookup(keys) == 0


def test_write_through_must_be_a_boolean():
    from kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tiers\.pool\.write_through"):
        runtime("127.0.0.1:1", write_through="sometimes")


def test_a_lookup_asks_only_for_what_it_lacks_and_counts_local_blocks_after_the_pools_run(node):
    keys = fresh_keys(4)
    rows = data(keys)
    with runtime(node.address) as a, runtime(node.address, write_through=False) as b:
        store(a, keys[:1], rows[:1], target=P)  # the first block: on the pool, from another process
        store(b, keys[1:2], rows[1:2])  # the second: this process's own DRAM, not on the pool
        assert b.lookup(keys) == 2  # the pool's block, then the local one; the third is on neither
        assert b.snapshot()["shared"] == {"adopted": 1, "asked": 3, "found": 1}  # the local key never asked
        out = torch.zeros_like(rows[:2])
        assert b.load(keys[:2], out).wait(WAIT_S) and torch.equal(out, rows[:2])


def test_a_block_another_writer_is_storing_is_waited_for_not_failed(node):
    key = fresh_keys(1)[0]
    row = data([key])
    peer = Raw(node.address)  # another process, half-way through its put of the same block
    status, region, offset, gen, _ = peer.call(MsgType.PUT_BEGIN, {"keys": [bytes(key)], "lengths": [LAYOUT.block_bytes],
                                                                   "lease_s": 30})["grants"][0]
    assert status == GrantStatus.GRANTED
    with runtime(node.address) as a:
        handle = a.store([key], row)  # DRAM, and through to the pool: BUSY there while the peer writes
        committed = threading.Event()

        def finish_peer() -> None:
            peer.call(MsgType.WRITE_COMMIT, {"region": region, "offset": offset, "gen": gen,
                                             "checksum": block_checksum(bytes(key), row[0].numpy())},
                      row[0].numpy().tobytes())
            committed.set()

        threading.Timer(0.2, finish_peer).start()
        assert handle.wait(WAIT_S) and not handle.failed
        assert committed.is_set()
        snap = a.snapshot()
        assert snap["shared"].get("awaited_peer") == 1, snap["shared"]
        assert snap["pool_client"].get("puts", 0) == 0 and snap["pool_client"]["put_rejected_busy"] == 1
        assert snap["stores"] == {"dram": 1, "pool": 1}
    peer.close()
    with PoolClient([node.address]) as client:
        got = bytearray(LAYOUT.block_bytes)
        assert client.get(bytes(key), got) and bytes(got) == row[0].numpy().tobytes()


def test_a_peer_that_never_finishes_costs_the_pool_copy_only(node):
    key = fresh_keys(1)[0]
    row = data([key])
    peer = Raw(node.address)  # starts a put of the block and stalls
    assert peer.call(MsgType.PUT_BEGIN, {"keys": [bytes(key)], "lengths": [LAYOUT.block_bytes],
                                         "lease_s": 30})["grants"][0][0] == GrantStatus.GRANTED
    with runtime(node.address, timeout_s=0.3) as a:
        handle = a.store([key], row)
        handle.wait(WAIT_S)
        a.quiesce(WAIT_S)
        assert a.where([key]) == [D]  # the DRAM copy stands; the pool's failed, counted
        snap = a.snapshot()
        assert snap["stores"] == {"dram": 1} and snap["io_errors"] == 1
        out = torch.zeros_like(row)
        assert a.load([key], out).wait(WAIT_S) and torch.equal(out, row)
    peer.close()


def test_a_pool_write_of_a_block_a_peer_sends_sends_nothing(node):
    keys = fresh_keys(2)
    with runtime(node.address) as a:
        a.tiers[P].writes_shared = False  # as a tensor-parallel rank whose slice another rank writes
        store(a, keys, data(keys))
        assert a.snapshot()["shared"]["left_to_peer"] == 2
        assert a.snapshot()["pool_client"].get("puts", 0) == 0
    with PoolClient([node.address]) as client:
        assert client.contains([bytes(k) for k in keys]) == [False, False]


def test_a_block_stored_here_just_after_a_lookup_missed_it_is_found_not_forgotten(node):
    # The lookup before a request's prefill asks the pool and caches its "absent" answers; the
    # blocks that request then stores must not be answered absent from that cache (they were
    # forgotten as gone from the pool, and counted dropped, until the answer expired).
    keys = fresh_keys(12)
    rows = data(keys)
    with runtime(node.address, negative_cache_s=60) as kv:
        assert kv.lookup(keys) == 0 and kv.snapshot()["shared"]["asked"] == 12
        store(kv, keys, rows)  # DRAM takes 8: 4 are in the pool alone
        assert kv.where(keys).count(P) == 4
        assert kv.lookup(keys) == 12 and kv.stats.num_dropped == 0, kv.snapshot()["dropped"]
        out = torch.zeros_like(rows)
        assert kv.load(keys, out).wait(WAIT_S) and torch.equal(out, rows)
