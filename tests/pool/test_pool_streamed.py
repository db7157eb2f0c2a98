"""Layer by layer from the pool: a load's first layers are delivered, checked, while the rest of the
block is still arriving, and a chunk that fails its check fails the block from that layer on.

Ordering is proved by a gate, never by timing: the reader's pool client holds the rest of a get
after its first chunks until the test opens the gate (as a slow network would), and the load
must report layer 0 meanwhile. Two `KVTier`s in one process stand for two processes (each has its
own client, index and slots). Cost: one node subprocess for the module.
"""

from __future__ import annotations

import struct
import threading

import pytest
import torch

from kvtier.config import config_from_dict
from kvtier.model.keys import Namespace, block_keys
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.streamed import BlockFrame, StreamedRead
from kvtier.pool.node.process import running_node
from kvtier.runtime import KVTier
from kvtier.tiers.base import TierKind
from kvtier.model.layout import BlockLayout
from support.runtime import WAIT_S

P = TierKind.POOL
SALTS = iter(range(1, 1 << 30))
# 4 layers of 64 KiB: a 256 KiB block, the smallest stored framed (16 chunks of 16 KiB, 4 per layer)
LAYOUT = BlockLayout.uniform(block_tokens=4, num_layers=4, layer_bytes=64 << 10)
LAYER = LAYOUT.offsets[1]
PER_LAYER = 4  # chunks
NAMESPACE = Namespace(model="kvtier-tiny", kv_dtype="fp16", block_tokens=LAYOUT.block_tokens)


def fresh_keys(n: int) -> list:
    return block_keys(NAMESPACE, [next(SALTS) for _ in range(n * LAYOUT.block_tokens)])


def data(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n, LAYOUT.block_bytes), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def node():
    with running_node(capacity="16MiB", region_size="512KiB") as n:
        yield n


def runtime(address: str, chunk_bytes: int = 0) -> KVTier:
    """DRAM and a pool share; chunk_bytes 0: a load copies and reports each layer on its own (1 MiB:
    a block of this layout is one copy, a whole-block read)."""
    return KVTier(config_from_dict({"model": "kvtier-tiny", "transfer": {"chunk_bytes": chunk_bytes}, "tiers": {
        "dram": {"capacity": 8 * LAYOUT.block_bytes, "high_watermark": 1.0, "low_watermark": 1.0},
        "pool": {"capacity": 16 * LAYOUT.block_bytes, "nodes": [address], "timeout_s": WAIT_S,
                 "reconnect_s": 0, "high_watermark": 1.0, "low_watermark": 1.0}}}), layout=LAYOUT)


def stored_by_another(address: str, keys, rows) -> None:
    with runtime(address) as other:
        handle = other.store(keys, rows, target=P)
        assert handle.wait(WAIT_S) and not handle.failed, handle.failed


class Gate:
    """Wraps a client's `get_streamed_many` (the streamed gets of a load's layer ranges): after
    `after` parts of a block have landed, the next one is held until `open()`, on the receiving
    thread, as a slow network would hold it."""

    def __init__(self, client: PoolClient, after: int) -> None:
        self.client, self.after = client, after
        self.inner = client.get_streamed_many
        self.gate, self.held = threading.Event(), threading.Event()
        self.landed: list[int] = []
        client.get_streamed_many = self.get

    def get(self, keys, parts, landed=None, checks_parts=None):
        def hold(key: int, part: int) -> None:
            if part == self.after:
                self.held.set()
                self.gate.wait(WAIT_S)
            self.landed.append(part)
            if landed is not None:
                landed(key, part)
        return self.inner(keys, parts, hold, checks_parts)

    def open(self) -> None:
        self.gate.set()


def test_the_first_layers_of_a_pool_block_are_delivered_while_the_rest_arrives(node):
    keys, rows = fresh_keys(1), data(1, 1)
    stored_by_another(node.address, keys, rows)
    with runtime(node.address) as kv:
        assert kv.lookup(keys) == 1
        frame = kv.tiers[P]._frame
        assert frame.framed and frame.num_chunks == PER_LAYER * LAYOUT.num_layers
        gate = Gate(kv.tiers[P]._client, after=1 + 2 * PER_LAYER)  # header, layers 0 and 1 in; layer 2 held
        out = torch.zeros_like(rows)
        handle = kv.load(keys, out)
        assert gate.held.wait(WAIT_S)
        handle.wait_layer(1, WAIT_S)  # returns with the get still held
        assert not gate.gate.is_set() and handle.layers_done == 2 and not handle.done()
        assert torch.equal(out[0, : 2 * LAYER], rows[0, : 2 * LAYER])
        assert not out[0, 2 * LAYER:].any(), "nothing of the held layers was delivered"
        gate.open()
        assert handle.wait(WAIT_S) and torch.equal(out, rows)
        assert gate.landed == list(range(frame.num_chunks + 1))
        assert kv.snapshot()["pool_client"]["hits"] == 1  # one get served the four layer reads


def test_a_chunk_that_fails_its_check_fails_the_block_from_that_layer_on(node):
    """A writer of the tenant stores an object whose header's checksum of chunk 2 is wrong (the
    node commits it: the whole object's checksum is right); a load delivers layers 0 and 1, then
    fails the block at layer 2, and nothing of layers 2-3 is delivered."""
    key, rows = fresh_keys(1)[0], data(1, 2)
    frame = BlockFrame(LAYOUT.block_bytes)
    header = bytearray(frame.header(bytes(key), rows[0]))
    struct.pack_into("<Q", header, 16 + 8 * 2 * PER_LAYER, 12345)  # the first chunk of layer 2
    obj = bytes(header) + rows[0].numpy().tobytes()
    with PoolClient([node.address]) as writer:
        assert writer.put(bytes(key), obj)
    with runtime(node.address) as kv:
        assert kv.lookup([key]) == 1
        out = torch.zeros_like(rows)
        handle = kv.load([key], out)
        handle.wait(WAIT_S)
        assert set(handle.failed) == {key} and handle.failed[key].layer == 2
        assert torch.equal(out[0, : 2 * LAYER], rows[0, : 2 * LAYER]) and not out[0, 2 * LAYER:].any()
        assert kv.snapshot()["dropped"] == {"read_io_error": 1}
        if kv.lookup([key]):  # found on the pool again: still never served as good
            out.zero_()
            assert not kv.load([key], out).wait(WAIT_S) and not out[0, 2 * LAYER:].any()


@pytest.mark.parametrize("stored", ["short header", "another version", "another block size"])
def test_an_object_of_another_format_under_a_block_key_is_a_miss(node, stored):
    key, rows = fresh_keys(1)[0], data(1, 3)
    frame = BlockFrame(LAYOUT.block_bytes)
    header, block = frame.header(bytes(key), rows[0]), rows[0].numpy().tobytes()
    obj = {"short header": header[:16] + block,
           "another version": header[:4] + struct.pack("<H", 9) + header[6:] + block,
           "another block size": block[:-4096]}[stored]
    with PoolClient([node.address]) as writer:
        assert writer.put(bytes(key), obj)
    for chunk_bytes in (0, 1 << 20):  # streamed layer reads, and one whole-block read
        with runtime(node.address, chunk_bytes) as kv:
            assert kv.lookup([key]) == 1
            out = torch.zeros_like(rows)
            handle = kv.load([key], out)
            assert not handle.wait(WAIT_S) and set(handle.failed) == {key}
            assert not out.any(), "nothing delivered"
            assert kv.snapshot()["pool_client"].get("wrong_size", 0) == (stored != "another version")


def test_a_block_stored_plain_is_read_whole_either_way(node):
    """A block with no header (a writer that stores this size plain) is a valid object: a streamed
    read delivers it once the whole get matched its checksum, a whole read at once."""
    key, rows = fresh_keys(1)[0], data(1, 4)
    with PoolClient([node.address]) as writer:
        assert writer.put(bytes(key), rows[0].numpy().tobytes())
    for chunk_bytes in (0, 1 << 20):
        with runtime(node.address, chunk_bytes) as kv:
            assert kv.lookup([key]) == 1
            out = torch.zeros_like(rows)
            assert kv.load([key], out).wait(WAIT_S) and torch.equal(out, rows)


def test_a_whole_block_read_lands_in_the_callers_buffer_in_one_part_after_its_header(node):
    """A load that copies whole blocks (chunk_bytes 1 MiB) gets a framed block straight into its own
    buffer: two parts, the header and the block, never one per chunk (each part is a receive call
    and a GIL hand-off: 17 of them per block cost a quarter of the fill rate at queue depth 4)."""
    keys, rows = fresh_keys(2), data(2, 5)
    stored_by_another(node.address, keys, rows)
    with runtime(node.address, 1 << 20) as kv:
        assert kv.lookup(keys) == 2
        client, seen = kv.tiers[P]._client, []
        inner = client.get_streamed_many

        def get(keys, parts, landed=None, checks_parts=None, summed=None):
            def recorded(j, length):
                got = parts(j, length)
                seen.append([g.numel() if isinstance(g, torch.Tensor) else len(g) for g in got])
                return got
            return inner(keys, recorded, landed, checks_parts, summed)

        client.get_streamed_many = get
        out = torch.zeros_like(rows)
        assert kv.load(keys, out).wait(WAIT_S) and torch.equal(out, rows)
        frame = kv.tiers[P]._frame
        assert seen == [[frame.header_bytes, LAYOUT.block_bytes]] * 2
        assert kv.snapshot()["pool_client"]["hits"] == 2


def test_a_node_whose_regions_cannot_hold_a_block_is_refused_at_start():
    from kvtier.errors import ConfigError

    with running_node(capacity="4MiB", region_size="256KiB") as small:  # 256 KiB + its header do not fit
        with pytest.raises(ConfigError, match=r"holds blocks of at most 262144 bytes .*--region-size"):
            runtime(small.address)


def test_a_streamed_read_that_the_pool_cannot_serve_tells_every_waiter():
    frame = BlockFrame(LAYOUT.block_bytes)
    read = StreamedRead(frame, b"k" * 16)
    read.run(lambda key, parts, landed, checks: False)
    assert read.failed
    from kvtier.errors import TierIOError

    with pytest.raises(TierIOError, match="not on the pool any more"):
        read.wait(1, WAIT_S)
    broken = StreamedRead(frame, b"k" * 16)
    broken.run(lambda key, parts, landed, checks: (_ for _ in ()).throw(RuntimeError("wire cut")))
    with pytest.raises(TierIOError, match="wire cut"):
        broken.wait(LAYOUT.block_bytes, WAIT_S)


@pytest.mark.parametrize("slot_bytes, chunk, chunks, framed", [
    (1, 1, 1, True), (4096, 4096, 1, False), (16 << 10, 4096, 4, False), (252 << 10, 16384, 16, False),
    (256 << 10, 16384, 16, True), (1 << 20, 64 << 10, 16, True), ((1 << 20) + 1, 69632, 16, True),
    (32 << 20, 2 << 20, 16, True)])
def test_chunks_are_a_sixteenth_of_a_block_and_the_header_costs_at_most_a_64th(slot_bytes, chunk, chunks, framed):
    """Framed where the header costs at most 1/64 of the block's 4 KiB pages (free where it fits the
    last page's padding, as for a 1-byte block)."""
    frame = BlockFrame(slot_bytes)
    assert (frame.chunk_bytes, frame.num_chunks, frame.framed) == (chunk, chunks, framed)
    assert frame.stored_bytes == slot_bytes + (frame.header_bytes if framed else 0)
    assert frame.bounds[-1][1] == slot_bytes and frame.header_bytes == 16 + 8 * chunks
    block = torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8)
    header = torch.frombuffer(bytearray(frame.header(b"k" * 16, block)), dtype=torch.uint8)
    sums = frame.checksums(header)
    assert all(frame.verify(b"k" * 16, sums, i, block) for i in range(chunks))
    assert not frame.verify(b"j" * 16, sums, 0, block), "bound to the key"
    if chunks > 1:
        assert not frame.verify(b"k" * 16, sums[1:] + sums[:1], 0, block), "bound to the chunk's place"
    assert BlockFrame(slot_bytes + 4096 * 16).checksums(header) is None, "another block size"
    raw = bytearray(header.numpy().tobytes())
    assert frame.is_header(memoryview(raw)) and not BlockFrame(slot_bytes + 4096 * 16).is_header(memoryview(raw))
    for at in (0, 4, 8, 12, 16 + 3):  # magic, version, chunk bytes, chunks; a sum is not the header's format
        bent = bytearray(raw)
        bent[at] ^= 1
        assert frame.is_header(memoryview(bent)) == (frame.checksums(torch.frombuffer(bent, dtype=torch.uint8))
                                                     is not None) == (at >= 16)
    assert not frame.is_header(memoryview(raw)[:-1]), "one byte short"
    with pytest.raises(ValueError, match=f"needs {slot_bytes} contiguous bytes in host memory"):
        frame.header(b"k" * 16, torch.zeros(slot_bytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError, match="torch.float32"):  # a count of items, not bytes, would hash past it
        frame.header(b"k" * 16, torch.zeros(slot_bytes, dtype=torch.float32))
