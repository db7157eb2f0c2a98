"""The TCP data plane: one-sided READ/WRITE frames against a node's regions.

The client names region, offset and generation exactly as an RDMA verb would name (addr, rkey);
the node checks tenant, generation and bounds on every access and streams the bytes between the
socket and its arena. A batch is pipelined on one connection, at most `PIPELINE_DEPTH` deep.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.errors import TransferError
from kvtier.pool.base import Location, RemoteIO, Transport
from kvtier.pool.client.connection import NodeLink, RemoteError, Request
from kvtier.pool.protocol import ErrorCode, MsgType


class TCPTransport(Transport):
    """Data-plane frames over a node's pooled control connections (`NodeLink`)."""

    name = "tcp"
    inline = True

    def __init__(self, link: NodeLink) -> None:
        self._link = link
        self._closed = False

    def read(self, location: Location, dst: memoryview) -> bool:
        return self.read_many([RemoteIO(location, dst)])[0]

    def write(self, location: Location, src: memoryview) -> bool:
        return self.write_many([RemoteIO(location, src)])[0]

    def read_many(self, ios: Sequence[RemoteIO], landed: Callable[[int], None] | None = None) -> list[bool]:
        """The READs pipelined on one connection; `landed(i)` as each reply's bytes are in."""
        return self._run([Request(MsgType.READ, _where(io, length=True), into=_sized(io),
                                  landed=None if landed is None else (lambda _, i=i: landed(i)))
                          for i, io in enumerate(ios)])

    def write_many(self, ios: Sequence[RemoteIO]) -> list[bool]:
        return self._run([_write_request(io) for io in ios])

    def close(self) -> None:
        self._closed = True

    def _run(self, requests: list[Request]) -> list[bool]:
        if self._closed:
            raise TransferError(f"pool node {self._link.name}: transport is closed")
        if not requests:
            return []
        with self._link.connection() as conn:
            replies = conn.call_many(requests)
        out = []
        for reply in replies:
            if isinstance(reply, RemoteError) and reply.code is not ErrorCode.STALE:
                raise TransferError(f"pool node {self._link.name}: {reply}")
            out.append(not isinstance(reply, RemoteError) and reply.get("committed", True))
        return out


def _write_request(io: RemoteIO) -> Request:
    where = _where(io, length=False)
    if io.commit_checksum is None:
        return Request(MsgType.WRITE, where, payload=_sized(io))
    return Request(MsgType.WRITE_COMMIT, {**where, "checksum": io.commit_checksum}, payload=_sized(io))


def _where(io: RemoteIO, length: bool) -> dict[str, int]:
    loc = io.location
    where = {"region": loc.region, "offset": loc.offset, "gen": loc.gen}
    if length:
        where["length"] = loc.length
    return where


def _sized(io: RemoteIO) -> memoryview:
    if len(io.buffer) != io.location.length:
        raise ValueError(f"buffer of {len(io.buffer)} bytes for a location of {io.location.length}")
    return io.buffer
