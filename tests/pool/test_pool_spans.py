"""`PoolTier.write_spans`/`read_spans` on two real pool nodes: a batch costs one call per node
(counted by the client's `node_calls` and by round trips on the node connections), failures come
back by index (a dead node fails only its blocks, a block a node dropped fails alone, never wrong
bytes), layer spans of a large block are gathered and put once and read through one streamed
get per node, private slots batch too.

Cost: about 3 s (two node subprocesses, one killed).
"""

from __future__ import annotations

import secrets
from collections import Counter
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvtier.errors import TierIOError
from kvtier.pool.client import connection
from kvtier.pool.client.api import PoolClient
from kvtier.pool import wire
from kvtier.pool.client.tier import PoolTier
from kvtier.pool.node.process import NodeProcess, start_nodes
from kvtier.pool.protocol import MsgType
from kvtier.moving import _movers
from kvtier.moving.copies import block_seed
from kvtier.tiers.base import LayerSums, SpanIO

NUM_BLOCKS = 16
SMALL = 64 << 10  # one span per block
LARGE = 256 << 10  # framed on the pool; written and read here in two spans


@pytest.fixture
def nodes() -> Iterator[list[NodeProcess]]:
    two = start_nodes(2, capacity="16MiB", region_size="1MiB")
    yield two
    for node in two:
        node.close()


def make_tier(nodes: list[NodeProcess], slot_bytes: int, shared: bool = True) -> PoolTier:
    client = PoolClient([n.address for n in nodes], timeout_s=5, reconnect_s=0.2)
    return PoolTier(client, 2 * NUM_BLOCKS * slot_bytes, slot_bytes, owns_client=True, shared=shared)


def rows(slot_bytes: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (NUM_BLOCKS, slot_bytes), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def span(tensors: torch.Tensor, keys: list, offset: int = 0, length: int | None = None) -> SpanIO:
    """A batch over slots 0..n-1, each to or from row i's bytes `[offset, offset + length)`."""
    length = tensors.shape[1] if length is None else length
    return SpanIO(list(range(len(keys))), offset, length,
                  [t.data_ptr() + offset for t in tensors], keys)


class RoundTrips:
    """Round trips on node connections, per node: each `call_many` (a request, or a pipelined
    burst of them, answered in one round trip) is one; a new connection's handshake is not counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: Counter = Counter()
        inner = connection.NodeConnection.call_many

        def counted(conn, requests, *args, **kwargs):
            if requests[0].msg not in (MsgType.HELLO, MsgType.AUTH):
                self.count[conn.name] += 1
            return inner(conn, requests, *args, **kwargs)

        monkeypatch.setattr(connection.NodeConnection, "call_many", counted)

    def take(self) -> Counter:
        out, self.count = self.count, Counter()
        return out


def homes(tier: PoolTier, keys: list[bytes]) -> list[int]:
    return [tier._client.home(k) for k in keys]


def test_a_batch_of_whole_blocks_costs_one_call_per_node(nodes, monkeypatch):
    tier = make_tier(nodes, SMALL)
    keys = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]
    assert set(homes(tier, keys)) == {0, 1}, "16 random keys land on both nodes"
    trips = RoundTrips(monkeypatch)
    data, calls = rows(SMALL, 1), tier.client_counters().get("node_calls", 0)
    assert tier.write_spans(span(data, keys)) == {}
    assert tier.client_counters()["node_calls"] - calls == 2
    ports = trips.take()
    assert len(ports) == 2 and all(n == 1 for n in ports.values()), ports
    out = torch.zeros_like(data)
    calls = tier.client_counters()["node_calls"]
    assert tier.read_spans(span(out, keys)) == {}
    assert torch.equal(out, data)
    assert tier.client_counters()["node_calls"] - calls == 2
    assert sorted(trips.take().values()) == [1, 1]
    assert tier.client_counters()["hits"] == NUM_BLOCKS
    tier.close()


def test_a_dead_node_fails_only_its_blocks(nodes):
    tier = make_tier(nodes, SMALL)
    keys = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]
    data = rows(SMALL, 2)
    assert tier.write_spans(span(data, keys)) == {}
    on_dead = {i for i, h in enumerate(homes(tier, keys)) if h == 1}
    assert on_dead and len(on_dead) < NUM_BLOCKS
    nodes[1].kill()
    out = torch.zeros_like(data)
    failed = tier.read_spans(span(out, keys))
    assert set(failed) == on_dead
    assert all(type(e) is TierIOError for e in failed.values()), failed  # the tier as a whole still serves
    for i in range(NUM_BLOCKS):
        if i not in on_dead:
            assert torch.equal(out[i], data[i])
    # A batch written while the node is down: the first meets it and fails only its blocks
    # (later ones go to the live node, by rendezvous order).
    fresh = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]
    planned = {i for i, k in enumerate(fresh) if tier._client.placement(k)[0] == 1}
    more = rows(SMALL, 3)  # held while the batch runs: a SpanIO carries addresses, not the tensor
    failed = tier.write_spans(span(more, fresh))
    assert set(failed) <= planned
    tier.close()


def test_a_block_a_node_dropped_fails_alone_never_wrong_bytes(nodes):
    tier = make_tier(nodes, SMALL)
    keys = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]
    data = rows(SMALL, 4)
    assert tier.write_spans(span(data, keys)) == {}
    with PoolClient([n.address for n in nodes]) as other:  # as the node's eviction would
        assert other.delete([keys[5]]) == 1
    out = torch.zeros_like(data)
    failed = tier.read_spans(span(out, keys))
    assert set(failed) == {5} and "not on the pool any more" in str(failed[5])
    assert not out[5].any(), "nothing of the dropped block was delivered"
    for i in set(range(NUM_BLOCKS)) - {5}:
        assert torch.equal(out[i], data[i])
    # written again: the tier knew it held the block, asks, finds it gone, and sends it again
    assert tier.write_spans(span(data, keys)) == {}
    assert tier.read_spans(span(out, keys)) == {} and torch.equal(out, data)
    tier.close()


class FlipOnArrival:
    """Corrupts the bytes of every received payload of `length` bytes (one bit of its middle
    byte) in this process, before anything hashes them: a node or a wire that returns wrong
    bytes. A receive that hashes layers as they land (`LayerSums`) hashes the corrupted bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, length: int) -> None:
        inner = wire.FrameSocket.recv_into
        self.flipped = 0

        def flipping(frames, view, deadline=None, sums=None):
            inner(frames, view, deadline)
            if len(view) == length:
                view[length // 2] ^= 1
                self.flipped += 1
            if sums is not None:
                hashed = layer_sums(view, sums)
                sums.out[:], sums.done = hashed, True

        monkeypatch.setattr(wire.FrameSocket, "recv_into", flipping)


def layer_sums(view, sums: LayerSums) -> list[int]:
    """What `sums` should read for the bytes of `view`: each layer's seeded xxh3-64."""
    data = bytes(view)
    return [_movers.xxh3(data[int(r): int(r) + int(n)], (sums.seed + sums.layer0 + l) % 2 ** 64)
            for l, (r, n) in enumerate(zip(sums.rel, sums.lengths))]


def whole_block_sums(key: bytes, num_layers: int = 4) -> LayerSums:
    """The `LayerSums` a route hands down for a whole SMALL block of `num_layers` equal layers."""
    size = SMALL // num_layers
    return LayerSums(np.arange(0, SMALL, size, dtype=np.uint64), np.full(num_layers, size, np.uint64),
                     block_seed(key), 0, np.zeros(num_layers, np.uint64))


def test_wrong_bytes_fail_the_tiers_own_check_unless_the_caller_checks_them(nodes, monkeypatch):
    """One pass over a block's bytes checks it: the tier's (the block's key-seeded checksum), or,
    where the caller checks the bytes against checksums of its own (`SpanIO.sums`: the runtime's
    per-layer checksums), the caller's alone, over the layer checksums the receive computed."""
    tier = make_tier(nodes, SMALL)
    keys = [secrets.token_bytes(16) for _ in range(4)]
    data = rows(SMALL, 7)[:4]
    assert tier.write_spans(span(data, keys)) == {}
    out = torch.zeros_like(data)
    io = span(out, keys)
    sums = [whole_block_sums(k) for k in keys]
    assert tier.read_spans(SpanIO(io.slots, io.offset, io.length, io.addresses, io.keys, sums)) == {}
    assert torch.equal(out, data)
    assert all(s.done and s.out.tolist() == layer_sums(memoryview(data[j].numpy()), s) for j, s in enumerate(sums)), \
        "the receive hashed each layer of the bytes that landed"
    flips = FlipOnArrival(monkeypatch, SMALL)
    out = torch.zeros_like(data)
    failed = tier.read_spans(span(out, keys))
    assert flips.flipped == 4 and set(failed) == {0, 1, 2, 3}
    assert all("failed its checksum" in str(e) for e in failed.values())
    assert tier.client_counters()["checksum_errors"] == 4 and tier.client_counters()["hits"] == 4
    io = span(out, keys)
    sums = [whole_block_sums(k) for k in keys]
    sums[2] = None
    failed = tier.read_spans(SpanIO(io.slots, io.offset, io.length, io.addresses, io.keys, sums))
    assert set(failed) == {2}, "the tier checks only the block its caller does not"
    assert tier.client_counters()["checksum_errors"] == 5 and tier.client_counters()["hits"] == 7
    for j in (0, 1, 3):  # left to the caller, with the checksums of what landed: not the block's
        assert sums[j].done and sums[j].out.tolist() == layer_sums(memoryview(out[j].numpy()), sums[j])
        assert sums[j].out.tolist() != layer_sums(memoryview(data[j].numpy()), sums[j])
    tier.close()


def test_the_runtime_checks_each_pool_block_once_and_never_serves_wrong_bytes(nodes, monkeypatch):
    """Through `KVTier.load`: blocks this process demoted to the pool carry its per-layer
    checksums, so the route checks them (hashed by the receive as they land) and the pool client
    does not hash them again; bytes corrupted on the way are a VERIFY failure, never served."""
    from kvtier.config import KVTierConfig, TierConfig
    from kvtier.model.layout import BlockLayout
    from kvtier.moving.handle import Stage
    from kvtier.runtime import KVTier
    from kvtier.tiers.base import TierKind

    layout = BlockLayout.uniform(16, 4, SMALL // 4)
    config = KVTierConfig(model="kvtier-test", tiers=(
        TierConfig(TierKind.HBM, 2 * SMALL, high_watermark=1e-6, low_watermark=1e-6, device="cpu"),
        TierConfig(TierKind.POOL, 8 * SMALL, high_watermark=1.0, low_watermark=1.0, write_through=False,
                   nodes=(nodes[0].address,), timeout_s=5)), promote_to=None)
    keys = [secrets.token_bytes(16) for _ in range(2)]
    data = rows(SMALL, 8)[:2]
    with KVTier(config, layout=layout) as kv:
        assert not kv.store(keys, data, target=TierKind.HBM, sync=True).failed
        kv.quiesce(30)
        assert kv.where(keys) == [TierKind.POOL, TierKind.POOL]
        client = kv.tiers[TierKind.POOL]._client
        hashed = []
        monkeypatch.setattr("kvtier.pool.client.node_calls._checksum",
                            lambda key, data: hashed.append(key) or 0)
        passes, copy_layers = [], _movers.copy_layers
        monkeypatch.setattr(_movers, "copy_layers", lambda *a, **k: passes.append(len(a[0])) or copy_layers(*a, **k))
        out = torch.zeros_like(data)
        assert not kv.load(keys, out, sync=True).failed and torch.equal(out, data)
        assert hashed == [] and client.counters["hits"] == 2, "checked by the route alone"
        assert passes == [], "the layers were hashed as they came off the socket, not in a second pass"
        flips = FlipOnArrival(monkeypatch, SMALL)
        handle = kv.load(keys, out, sync=True)
        assert flips.flipped == 2 and set(handle.failed) == set(keys)
        assert all(f.stage is Stage.VERIFY for f in handle.failed.values())
        assert all("layer 2 from pool" in f.error for f in handle.failed.values()), \
            "the layer whose bytes changed (the middle byte of 4 layers) is the one named"
        assert kv.stats.checksum_errors == 2 and client.counters.get("checksum_errors", 0) == 0


def test_layer_spans_of_large_blocks_are_gathered_and_put_once_per_node(nodes):
    tier = make_tier(nodes, LARGE)
    assert tier._frame.framed
    keys = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]
    data, half = rows(LARGE, 5), LARGE // 2
    calls = tier.client_counters().get("node_calls", 0)
    assert tier.write_spans(span(data, keys, 0, half)) == {}
    assert tier.client_counters().get("node_calls", 0) == calls, "nothing sent before a block is whole"
    assert tier.write_spans(span(data, keys, half, half)) == {}
    assert tier.client_counters()["node_calls"] - calls == 2
    whole = torch.zeros_like(data)
    assert tier.read_spans(span(whole, keys)) == {} and torch.equal(whole, data)
    parts = torch.zeros_like(data)  # streamed, layer span by layer span: one get per node for both spans
    calls = tier.client_counters()["node_calls"]
    assert tier.read_spans(span(parts, keys, 0, half)) == {}
    assert torch.equal(parts[:, :half], data[:, :half])
    assert tier.read_spans(span(parts, keys, half, half)) == {}
    assert torch.equal(parts, data)
    assert tier.client_counters()["node_calls"] - calls == 2
    tier.close()


def test_private_slots_batch_per_node(nodes, monkeypatch):
    tier = make_tier(nodes, SMALL, shared=False)
    keys = [secrets.token_bytes(16) for _ in range(NUM_BLOCKS)]  # private: sharing is off
    data = rows(SMALL, 6)
    calls = tier.client_counters().get("node_calls", 0)
    assert tier.write_spans(span(data, keys)) == {}
    used = tier.client_counters()["node_calls"] - calls
    assert used <= 4, "one ALLOC and one batch of writes per node"
    trips = RoundTrips(monkeypatch)
    patch = rows(SMALL, 7)
    assert tier.write_spans(span(patch, keys, 1000, 3000)) == {}
    assert tier.client_counters()["node_calls"] - calls - used <= 2
    out = torch.zeros_like(data)
    assert tier.read_spans(span(out, keys)) == {}
    expected = data.clone()
    expected[:, 1000:4000] = patch[:, 1000:4000]
    assert torch.equal(out, expected)
    assert sum(trips.take().values()) <= 4  # a pipelined batch per node, each way
    tier.close()
