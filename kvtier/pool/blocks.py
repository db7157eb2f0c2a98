"""The pool node's bookkeeping records: regions, blocks, tenants, and what the store hands out.

Plain data; `store.BlockStore` owns every instance and is the only code that changes them.
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
    written: int = 0  # bytes written by successful WRITEs while WRITING: commit needs >= length
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


class AccessError(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
