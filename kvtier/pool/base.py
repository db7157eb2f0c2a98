"""The `Transport` interface: how block bytes move between a client and one pool node.

The control plane (TCP frames: authenticate, allocate, look up, lease, commit) decides *where* a
block's bytes are: a `Location` in one of the tenant's regions on the node. A transport then moves
the bytes **one-sided**: the client names region and offset, and the node takes no decision. Two
implementations fit this shape:

- TCP (`transport_tcp.TCPTransport`): READ/WRITE frames on the control connection; the node checks
  tenant, generation and bounds on every access and reports a reused slot as stale.
- RDMA (planned, pyverbs): RDMA READ/WRITE on an RC queue pair against the region's `(addr, rkey)`,
  learned over the control plane; batches become chained work requests with selective signalling.
  The node's CPU sees nothing, so a reused slot cannot be reported: the client's checksum (xxh3-64,
  carried with every keyed block) turns such a read into a miss, and read leases keep slots from
  reuse in the first place.

Buffers are flat, contiguous `memoryview`s of bytes (writable for reads).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Location:
    """`length` bytes at byte `offset` of the tenant's region `region` on one node, valid while
    that slot holds allocation `gen`."""

    region: int
    offset: int
    length: int
    gen: int

    def sub(self, offset: int, length: int) -> Location:
        """The range `[offset, offset + length)` of this location.

        Raises:
            IndexError: the range is outside the location.
        """
        if offset < 0 or length < 0 or offset + length > self.length:
            raise IndexError(f"range [{offset}, {offset + length}) outside a block of {self.length} bytes")
        return Location(self.region, self.offset + offset, length, self.gen)


@dataclass(frozen=True, slots=True)
class RemoteIO:
    """One one-sided access: `buffer` (exactly `location.length` bytes) to or from `location`.

    `commit_checksum` (writes only, on an `inline` transport): the write fills a whole block begun
    with PUT_BEGIN, and the node commits it with this checksum once the bytes are in.
    """

    location: Location
    buffer: memoryview
    commit_checksum: int | None = None


class Transport(ABC):
    """Moves bytes to and from one node's regions. Safe to call from several threads at once.

    Contract (`kvtier.testing.transport_contract`, run against every implementation):
    - `read`/`write` return True when all bytes moved; False when the node reports the location
      stale (the slot no longer holds that allocation) — a miss, nothing partial is reported as
      moved. A transport that cannot detect staleness returns True; callers verify checksums.
    - They raise `TransferError` when the node is unreachable, the call outlives the transport's
      timeout, or the node refuses the access (another tenant's region, out of bounds); the bytes
      of a read buffer are then undefined. No call blocks past the timeout.
    - After `close()` (idempotent) every call raises `TransferError`.
    """

    name: str  # "tcp" or "rdma": reported to users, never silently swapped
    # True when bytes travel on the control connection itself (TCP), so control and data can share
    # a round trip: a write with `commit_checksum` also commits the block (its result is True only
    # once committed), and a client may ask GET to send hits inline instead of leasing them for a
    # READ. False (RDMA: the node's CPU never sees a one-sided access): `commit_checksum` is
    # ignored, the caller commits with PUT_COMMIT and reads with leases.
    inline: bool = False

    @abstractmethod
    def read(self, location: Location, dst: memoryview) -> bool:
        """Copies `location` into `dst` (`len(dst) == location.length`).

        Returns:
            True when copied; False when the location is stale.
        Raises:
            TransferError: the node is unreachable, timed out or refused the access.
        """

    @abstractmethod
    def write(self, location: Location, src: memoryview) -> bool:
        """Copies `src` (`len(src) == location.length`) into `location`.

        Returns:
            True when written; False when the location is stale.
        Raises:
            TransferError: as `read`.
        """

    def read_many(self, ios: Sequence[RemoteIO], landed: Callable[[int], None] | None = None) -> list[bool]:
        """Batched `read`, one result per io in order; the default reads one by one.

        Args:
            landed: called with i once io i's bytes are in its buffer (in order, never for an io
                that failed), so that a caller can use the first ranges of a block while the rest
                is still moving; it must not raise.
        Raises:
            TransferError: as `read`; then no result of the batch is known.
        """
        out = []
        for i, io in enumerate(ios):
            out.append(self.read(io.location, io.buffer))
            if out[-1] and landed is not None:
                landed(i)
        return out

    def write_many(self, ios: Sequence[RemoteIO]) -> list[bool]:
        """Batched `write`; as `read_many`."""
        return [self.write(io.location, io.buffer) for io in ios]

    def register_memory(self, address: int, length: int, owner: object) -> None:
        """Declares host memory that later buffers will lie in (a DRAM tier's slab), so a transport
        that can move bytes straight from and into it (RDMA: one memory registration, no staging
        copy) does. `owner` keeps the memory alive while the transport may use it. The default
        does nothing: TCP copies through the socket either way.
        """

    def close(self) -> None:
        """Releases connections or queue pairs. Idempotent."""
