"""The `Transport` contract, run against every data-plane implementation: TCP, and the verbs
transport over `kvtier.testing.fake_verbs` (the node runs `--transport rdma` on the fake fabric, the
fake moving bytes into the node process's memory one-sidedly; it serves TCP frames too).

Locations come from the control plane (`PoolClient.alloc`), exactly as a client gets them; the node
is a real `kvtier pool serve` subprocess. Cost: about 3 s, mostly the node's start.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.errors import TransferError
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.client.api import PoolClient, Slot
from kvtier.pool.client.connection import NodeLink
from kvtier.testing.pool import FAKE_VERBS, rdma_node
from kvtier.pool.client.rdma import RDMATransport
from kvtier.pool.client.tcp import TCPTransport
from kvtier.units import parse_address

BLOCK = 20_000  # not a multiple of 4 KiB
TRANSPORTS: dict[str, Callable[[NodeLink], Transport]] = {
    "tcp": TCPTransport, "rdma-fake": lambda link: RDMATransport(link, verbs=FAKE_VERBS)}


def detects_stale(t: Transport) -> bool:
    """One-sided RDMA cannot see a reused slot (base.py's contract: it returns True and callers
    verify checksums), nor a range past the block but inside the tenant's region."""
    return getattr(t, "detects_stale", True)


@pytest.fixture(scope="module")
def node_address(tmp_path_factory) -> Iterator[str]:
    with rdma_node("fake", tmp_path_factory.mktemp("fabric"), capacity="8MiB", region_size="256KiB") as node:
        yield node.address


@pytest.fixture
def client(node_address) -> Iterator[PoolClient]:
    with PoolClient([node_address], timeout_s=30) as c:  # a safety net, never a measurement
        yield c


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request, client) -> Iterator[Transport]:
    t = TRANSPORTS[request.param](client.links[0])
    yield t
    t.close()


def alloc(client: PoolClient, n: int = 1) -> list[Slot]:
    return [client.alloc(os.urandom(16), BLOCK) for _ in range(n)]


def view(data: bytes | bytearray) -> memoryview:
    return memoryview(bytearray(data))


def test_write_then_read_whole_blocks_and_sub_ranges(transport: Transport, client) -> None:
    (slot,) = alloc(client)
    data = os.urandom(BLOCK)
    assert transport.write(slot.location, view(data)) is True
    out = view(bytes(BLOCK))
    assert transport.read(slot.location, out) is True and out == data
    patch = os.urandom(777)
    assert transport.write(slot.location.sub(4095, 777), view(patch))
    out = view(bytes(BLOCK))
    assert transport.read(slot.location, out)
    assert bytes(out) == data[:4095] + patch + data[4095 + 777:]
    part = view(bytes(10))
    assert transport.read(slot.location.sub(BLOCK - 10, 10), part) and bytes(part) == data[-10:]


def test_batches_report_per_io_in_order(transport: Transport, client) -> None:
    slots = alloc(client, 70)  # more than one pipeline window
    datas = [os.urandom(BLOCK) for _ in slots]
    assert transport.write_many([RemoteIO(s.location, view(d)) for s, d in zip(slots, datas)]) == [True] * 70
    client.free([slots[3]])  # one of them goes stale
    outs = [view(bytes(BLOCK)) for _ in slots]
    got = transport.read_many([RemoteIO(s.location, o) for s, o in zip(slots, outs)])
    assert got == [i != 3 or not detects_stale(transport) for i in range(70)]
    assert all(o == d for o, d, ok in zip(outs, datas, got) if ok)
    assert transport.read_many([]) == [] and transport.write_many([]) == []


def test_a_stale_location_is_false_not_an_error(transport: Transport, client) -> None:
    (slot,) = alloc(client)
    client.free([slot])
    if not detects_stale(transport):  # one-sided: the NIC cannot tell; the caller's checksum catches it
        assert transport.read(slot.location, view(bytes(BLOCK))) is True
        return
    assert transport.read(slot.location, view(bytes(BLOCK))) is False
    assert transport.write(slot.location, view(bytes(BLOCK))) is False
    newer = Location(slot.location.region, slot.location.offset, BLOCK, slot.location.gen + 10**9)
    assert transport.read(newer, view(bytes(BLOCK))) is False


@pytest.mark.parametrize("shift,length", [(BLOCK - 5, 10), (1 << 40, 1)], ids=["past-the-block", "past-the-region"])
def test_out_of_bounds_access_raises(transport: Transport, client, shift: int, length: int) -> None:
    (slot,) = alloc(client)
    loc = slot.location
    beyond = Location(loc.region, loc.offset + shift, length, loc.gen)
    if shift < BLOCK and not detects_stale(transport):
        # One-sided: block bounds inside the tenant's own region are not visible to the NIC, so the
        # access reaches the tenant's neighbouring bytes (never another tenant's); checksums judge them.
        assert transport.read(beyond, view(bytes(length))) is True
        return
    with pytest.raises(TransferError, match="BOUNDS"):
        transport.read(beyond, view(bytes(length)))
    with pytest.raises(TransferError, match="BOUNDS"):
        transport.write(beyond, view(bytes(length)))
    assert transport.read(loc, view(bytes(BLOCK))), "the connection survives a refused access"


def test_mismatched_buffer_size_raises_value_error(transport: Transport, client) -> None:
    (slot,) = alloc(client)
    with pytest.raises(ValueError):
        transport.read(slot.location, view(bytes(BLOCK - 1)))


def test_unreachable_node_raises_transfer_error() -> None:
    for make in TRANSPORTS.values():
        link = NodeLink("127.0.0.1:1", parse_address("127.0.0.1:1", "test"), "default", b"",
                        timeout_s=2, reconnect_s=0)
        with pytest.raises(TransferError):
            make(link).read(Location(0, 0, 10, 1), view(bytes(10)))


def test_concurrent_threads(transport: Transport, client) -> None:
    slots = alloc(client, 8)
    start = threading.Barrier(len(slots))

    def worker(slot: Slot) -> bool:
        data = os.urandom(BLOCK)
        start.wait()
        for _ in range(10):
            if not transport.write(slot.location, view(data)):
                return False
            out = view(bytes(BLOCK))
            if not transport.read(slot.location, out) or out != data:
                return False
        return True

    with ThreadPoolExecutor(len(slots)) as pool:
        assert all(pool.map(worker, slots))


def test_close_is_idempotent_and_later_calls_raise(transport: Transport, client) -> None:
    (slot,) = alloc(client)
    transport.close()
    transport.close()
    with pytest.raises(TransferError):
        transport.read(slot.location, view(bytes(BLOCK)))
    with pytest.raises(TransferError):
        transport.write(slot.location, view(bytes(BLOCK)))
