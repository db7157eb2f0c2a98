"""The `Transport` contract (a pool data plane: one-sided reads and writes at locations the
control plane handed out), as a pytest class any transport's tests can reuse.

kvtier runs it against TCP and the verbs transport (tests/pool/test_pool_transport.py); another
transport runs it by subclassing and giving two fixtures:

    class TestMyTransport(TransportContract):
        @pytest.fixture
        def client(self):            # a PoolClient connected to a node that serves this transport
            ...
        @pytest.fixture
        def transport(self, client): # the transport under test, over client.links[0]; closed after
            ...

Locations come from `client.alloc`, exactly as a client gets them.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvtier.errors import TransferError
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.client.api import PoolClient, Slot

BLOCK = 20_000  # not a multiple of 4 KiB


def detects_stale(t: Transport) -> bool:
    """One-sided RDMA cannot see a reused slot (base.py's contract: it returns True and callers
    verify checksums), nor a range past the block but inside the tenant's region."""
    return getattr(t, "detects_stale", True)


def alloc(client: PoolClient, n: int = 1) -> list[Slot]:
    return [client.alloc(os.urandom(16), BLOCK) for _ in range(n)]


def view(data: bytes | bytearray) -> memoryview:
    return memoryview(bytearray(data))


class TransportContract:
    """Every test a `Transport` must pass; a subclass provides the `client` and `transport` fixtures."""

    @pytest.fixture
    def client(self) -> PoolClient:
        raise NotImplementedError("a TransportContract subclass provides the client fixture")

    @pytest.fixture
    def transport(self, client: PoolClient) -> Transport:
        raise NotImplementedError("a TransportContract subclass provides the transport fixture")

    def test_write_then_read_whole_blocks_and_sub_ranges(self, transport: Transport, client) -> None:
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

    def test_batches_report_per_io_in_order(self, transport: Transport, client) -> None:
        slots = alloc(client, 70)  # more than one pipeline window
        datas = [os.urandom(BLOCK) for _ in slots]
        assert transport.write_many([RemoteIO(s.location, view(d)) for s, d in zip(slots, datas)]) == [True] * 70
        client.free([slots[3]])  # one of them goes stale
        outs = [view(bytes(BLOCK)) for _ in slots]
        got = transport.read_many([RemoteIO(s.location, o) for s, o in zip(slots, outs)])
        assert got == [i != 3 or not detects_stale(transport) for i in range(70)]
        assert all(o == d for o, d, ok in zip(outs, datas, got) if ok)
        assert transport.read_many([]) == [] and transport.write_many([]) == []

    def test_a_stale_location_is_false_not_an_error(self, transport: Transport, client) -> None:
        # A second block keeps the region the tenant's: a node hands back a region whose last
        # block goes, and a read there is then a miss for every transport (run alone, this test
        # would see that, not a stale slot).
        slot, _keep = alloc(client, 2)
        client.free([slot])
        if not detects_stale(transport):  # one-sided: the NIC cannot tell; the caller's checksum catches it
            assert transport.read(slot.location, view(bytes(BLOCK))) is True
            return
        assert transport.read(slot.location, view(bytes(BLOCK))) is False
        assert transport.write(slot.location, view(bytes(BLOCK))) is False
        newer = Location(slot.location.region, slot.location.offset, BLOCK, slot.location.gen + 10**9)
        assert transport.read(newer, view(bytes(BLOCK))) is False

    @pytest.mark.parametrize("shift,length", [(BLOCK - 5, 10), (1 << 40, 1)], ids=["past-the-block", "past-the-region"])
    def test_out_of_bounds_access_raises(self, transport: Transport, client, shift: int, length: int) -> None:
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

    def test_mismatched_buffer_size_raises_value_error(self, transport: Transport, client) -> None:
        (slot,) = alloc(client)
        with pytest.raises(ValueError):
            transport.read(slot.location, view(bytes(BLOCK - 1)))

    def test_concurrent_threads(self, transport: Transport, client) -> None:
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

    def test_close_is_idempotent_and_later_calls_raise(self, transport: Transport, client) -> None:
        (slot,) = alloc(client)
        transport.close()
        transport.close()
        with pytest.raises(TransferError):
            transport.read(slot.location, view(bytes(BLOCK)))
        with pytest.raises(TransferError):
            transport.write(slot.location, view(bytes(BLOCK)))
