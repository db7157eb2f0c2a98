"""The `Transport` contract (`kvtier.testing.transport_contract`), run against every data-plane implementation: TCP, and the verbs
transport over `kvtier.testing.fake_verbs` (the node runs `--transport rdma` on the fake fabric, the
fake moving bytes into the node process's memory one-sidedly; it serves TCP frames too).

Locations come from the control plane (`PoolClient.alloc`), exactly as a client gets them; the node
is a real `kvtier pool serve` subprocess. Cost: about 3 s, mostly the node's start.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.errors import TransferError
from kvtier.pool.base import Location, Transport
from kvtier.pool.client.api import PoolClient
from kvtier.pool.client.connection import NodeLink
from kvtier.testing.pool import FAKE_VERBS, rdma_node
from kvtier.pool.client.rdma import RDMATransport
from kvtier.pool.client.tcp import TCPTransport
from kvtier.testing.transport_contract import TransportContract, view
from kvtier.units import parse_address

TRANSPORTS: dict[str, Callable[[NodeLink], Transport]] = {
    "tcp": TCPTransport, "rdma-fake": lambda link: RDMATransport(link, verbs=FAKE_VERBS)}


@pytest.fixture(scope="module")
def node_address(tmp_path_factory) -> Iterator[str]:
    with rdma_node("fake", tmp_path_factory.mktemp("fabric"), capacity="8MiB", region_size="256KiB") as node:
        yield node.address


@pytest.fixture
def pool_client(node_address) -> Iterator[PoolClient]:
    with PoolClient([node_address], timeout_s=30) as c:  # a safety net, never a measurement
        yield c


@pytest.fixture(params=sorted(TRANSPORTS))
def any_transport(request, pool_client) -> Iterator[Transport]:
    t = TRANSPORTS[request.param](pool_client.links[0])
    yield t
    t.close()


def test_unreachable_node_raises_transfer_error() -> None:
    for make in TRANSPORTS.values():
        link = NodeLink("127.0.0.1:1", parse_address("127.0.0.1:1", "test"), "default", b"",
                        timeout_s=2, reconnect_s=0)
        with pytest.raises(TransferError):
            make(link).read(Location(0, 0, 10, 1), view(bytes(10)))


class TestEveryTransport(TransportContract):
    """The whole contract (`kvtier.testing.transport_contract`) against TCP and the verbs transport."""

    @pytest.fixture
    def client(self, pool_client: PoolClient) -> PoolClient:
        return pool_client

    @pytest.fixture
    def transport(self, any_transport: Transport) -> Transport:
        return any_transport
