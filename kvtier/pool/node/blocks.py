"""The pool node's bookkeeping records: regions, blocks, tenants, and what the store hands out.

Plain data; `store.BlockStore` owns every instance and is the only code that changes them
(`cover` is the one rule kept here: what a WRITING block has had written).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.pool.protocol import ErrorCode, GrantStatus


class BlockState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass(eq=False, slots=True)
class Region:
    id: int
    base: int  # byte offset in the node's arena
    size: int
    tenant: str | None = None
    slot_bytes: int = 0
    free: list[int] = field(default_factory=list)
    blocks: dict[int, Block] = field(default_factory=dict)  # slot -> block
    num_busy: int = 0
    last_use: int = 0
    last_tenant: str | None = None  # whose bytes the region may still hold (None: zeros only)
    dirty_bytes: int = 0  # bytes from the region's start allocated since it was last zeroed


@dataclass(eq=False, slots=True)
class Block:
    tenant: str
    key: bytes
    region: Region
    slot: int
    length: int
    gen: int
    state: BlockState
    mutable: bool = False
    checksum: int = 0
    last_use: int = 0
    leases: int = 0
    inflight: int = 0
    written: int = 0  # while WRITING: [0, written) was written (see `cover`); commit needs all of it
    islands: list[tuple[int, int]] | None = None  # written ranges past a gap, sorted and disjoint
    write_lease: int = 0

    @property
    def busy(self) -> bool:
        return self.leases > 0 or self.inflight > 0

    @property
    def offset(self) -> int:
        """Byte offset of the block in its region."""
        return self.slot * self.region.slot_bytes


@dataclass(eq=False, slots=True)
class TenantState:
    quota_bytes: int
    counters: dict[str, int]  # this tenant's own events (what its STATS shows)
    used_bytes: int = 0
    index: dict[bytes, Block] = field(default_factory=dict)
    lru: dict[int, OrderedDict] = field(default_factory=dict)  # slot_bytes -> key -> Block, oldest first
    open_regions: dict[int, dict[int, Region]] = field(default_factory=dict)  # slot_bytes -> regions with free slots


@dataclass(frozen=True, slots=True)
class Grant:
    status: GrantStatus
    block: Block | None = None
    lease: int = 0


@dataclass(frozen=True, slots=True)
class Access:
    """A data-plane access in flight: `arena_offset` is where its bytes are; end it with `end_access`."""

    block: Block
    arena_offset: int
    length: int
    write: bool


MAX_WRITE_ISLANDS = 32  # disjoint written ranges past a gap one WRITING block remembers


def cover(block: Block, start: int, end: int) -> None:
    """Records that bytes [start, end) of a WRITING block were written.

    Why ranges, not a byte count: a count lets 16 WRITEs of the same 4 KiB "complete" a 64 KiB
    block whose other 60 KiB still hold whatever the slot held before. A usual put writes the
    block whole or front to back, so it only ever moves `written` forward (no list is made); a
    range past a gap waits in `islands` until the gap fills. Past MAX_WRITE_ISLANDS a range is not
    recorded (memory stays bounded): coverage may then fall short, never claim an unwritten byte.
    """
    if start > block.written:
        islands = block.islands or []
        if len(islands) < MAX_WRITE_ISLANDS:
            block.islands = _merged(islands, start, end)
        return
    block.written = max(block.written, end)
    if block.islands:
        while block.islands and block.islands[0][0] <= block.written:
            block.written = max(block.written, block.islands.pop(0)[1])


def _merged(ranges: list[tuple[int, int]], start: int, end: int) -> list[tuple[int, int]]:
    """`ranges` (sorted, disjoint) with [start, end) added, overlapping or touching ones joined."""
    out = []
    for s, e in ranges:
        if e < start or s > end:
            out.append((s, e))
        else:
            start, end = min(s, start), max(e, end)
    out.append((start, end))
    out.sort()
    return out


class AccessError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
