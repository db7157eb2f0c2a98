"""Zero-copy RDMA: host memory declared with `register_memory` is registered with the NIC once,
and buffers inside it are the work requests' own scatter/gather entries (no staging memcpy); any
other buffer still goes through the staging buffer. Run on the fake verbs NIC (it refuses a
scatter/gather entry outside a registered MR, and a READ into an MR without local write access,
as hardware does) against a real `kvtier pool serve --transport rdma` subprocess; and, marked
`rdma`, the same on a real device (skipped where there is none). Cost: about 2 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import pytest

from kvtier.pool.base import RemoteIO
from kvtier.pool.client.api import PoolClient
from kvtier.pool.node.process import NodeProcess
from kvtier.testing.pool import rdma_node
from kvtier.pool.client.rdma import STAGING_BYTES, RDMATransport

BLOCK = 20_000




REAL = pytest.param("pyverbs", marks=pytest.mark.rdma)


@pytest.fixture(scope="module", params=["fake", REAL])
def node(request, tmp_path_factory) -> Iterator[NodeProcess]:
    fabric = tmp_path_factory.mktemp("fabric") if request.param == "fake" else None
    with rdma_node(request.param, fabric, capacity="8MiB", region_size="256KiB") as node:
        yield node


@pytest.fixture
def client(node) -> Iterator[PoolClient]:
    with PoolClient([node.address], timeout_s=30) as c:  # a safety net, never a measurement
        yield c


@pytest.fixture
def transport(client, node) -> Iterator[RDMATransport]:
    t = RDMATransport(client.links[0], verbs=node.verbs)
    yield t
    t.close()


def address(buf: bytearray) -> int:
    return int(np.frombuffer(buf, dtype=np.uint8).ctypes.data)


def locations(client: PoolClient, n: int) -> list:
    return [client.alloc(os.urandom(16), BLOCK).location for _ in range(n)]


@pytest.mark.parametrize("register_after_connect", [False, True], ids=["before-connect", "after-connect"])
def test_buffers_in_registered_memory_move_without_staging(transport, client, register_after_connect) -> None:
    slab = bytearray(8 * BLOCK)  # stands in for a DRAM tier's slab
    locs = locations(client, 4)
    if register_after_connect:
        assert transport.write(locs[0], memoryview(bytearray(os.urandom(BLOCK))))  # connects, staged
        staged_before = transport.staged_bytes
        assert staged_before == BLOCK and transport.zero_copy_bytes == 0
    transport.register_memory(address(slab), len(slab), slab)
    staged_before = transport.staged_bytes
    view = memoryview(slab)
    data = [os.urandom(BLOCK) for _ in locs]
    for i, d in enumerate(data):
        view[i * BLOCK: (i + 1) * BLOCK] = d
    ios = [RemoteIO(loc, view[i * BLOCK: (i + 1) * BLOCK]) for i, loc in enumerate(locs)]
    assert transport.write_many(ios) == [True] * 4
    assert (transport.zero_copy_bytes, transport.staged_bytes) == (4 * BLOCK, staged_before)
    back = [RemoteIO(loc, view[(4 + i) * BLOCK: (5 + i) * BLOCK]) for i, loc in enumerate(locs)]
    assert transport.read_many(back) == [True] * 4
    assert (transport.zero_copy_bytes, transport.staged_bytes) == (8 * BLOCK, staged_before)
    assert [bytes(view[(4 + i) * BLOCK: (5 + i) * BLOCK]) for i in range(4)] == data, "read straight into the slab"


def test_a_batch_mixing_registered_and_scratch_buffers(transport, client) -> None:
    slab = bytearray(2 * BLOCK)
    transport.register_memory(address(slab), len(slab), slab)
    transport.register_memory(address(slab) + BLOCK, BLOCK, slab)  # inside an earlier one: registered once
    a, b = locations(client, 2)
    inside, outside = memoryview(slab)[:BLOCK], memoryview(bytearray(BLOCK))
    inside[:], outside[:] = os.urandom(BLOCK), os.urandom(BLOCK)
    a_data, b_data = bytes(inside), bytes(outside)
    assert transport.write_many([RemoteIO(a, inside), RemoteIO(b, outside)]) == [True, True]
    assert (transport.zero_copy_bytes, transport.staged_bytes) == (BLOCK, BLOCK)
    straddling = memoryview(slab)[BLOCK // 2: BLOCK // 2 + BLOCK]  # inside the slab, not past it
    scratch = memoryview(bytearray(BLOCK))
    assert transport.read_many([RemoteIO(b, straddling), RemoteIO(a, scratch)]) == [True, True]
    assert bytes(straddling) == b_data and bytes(scratch) == a_data
    assert transport.staged_bytes == 2 * BLOCK and transport.zero_copy_bytes == 2 * BLOCK


def test_registered_memory_is_kept_across_a_reconnect(transport, client) -> None:
    slab = bytearray(BLOCK)
    transport.register_memory(address(slab), len(slab), slab)
    (loc,) = locations(client, 1)
    memoryview(slab)[:] = os.urandom(BLOCK)
    assert transport.write(loc, memoryview(slab))
    transport._teardown()  # as after an error completion: the next call reconnects
    out = bytearray(BLOCK)
    transport.register_memory(address(out), len(out), out)
    assert transport.read(loc, memoryview(out)) and out == slab
    assert transport.staged_bytes == 0 and transport.zero_copy_bytes == 2 * BLOCK


def test_register_memory_rejects_an_empty_range(transport) -> None:
    with pytest.raises(ValueError, match="length must be positive"):
        transport.register_memory(4096, 0, None)


def test_memory_the_device_refuses_to_register_is_staged_and_said(tmp_path, monkeypatch) -> None:
    with rdma_node("fake", tmp_path, capacity="8MiB", region_size="256KiB") as node, \
            PoolClient([node.address], timeout_s=30) as client:  # only the fake can be made to refuse
        transport = RDMATransport(client.links[0], verbs=node.verbs)
        monkeypatch.setenv("KVTIER_FAKE_MEMLOCK", str(STAGING_BYTES + 4096))  # the staging buffer fits, no more
        slab = bytearray(2 * BLOCK)
        transport.register_memory(address(slab), len(slab), slab)
        (loc,) = locations(client, 1)
        memoryview(slab)[:BLOCK] = os.urandom(BLOCK)
        assert transport.write(loc, memoryview(slab)[:BLOCK])
        assert transport.read(loc, memoryview(slab)[BLOCK:])
        transport.close()
    assert slab[:BLOCK] == slab[BLOCK:]
    assert (transport.zero_copy_bytes, transport.staged_bytes) == (0, 2 * BLOCK)
    assert "cannot register" in transport.zero_copy_error and "ulimit -l" in transport.zero_copy_error
