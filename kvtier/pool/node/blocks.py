"""The pool node's bookkeeping records: regions, blocks, tenants, and what the store hands out.

Plain data; `store.BlockStore` owns every instance and is the only code that changes them
(`cover` is the one rule kept here: what a WRITING block has had written).

Blocks are columns, not objects (`BlockTable`): a node holding millions of blocks would otherwise
keep one object per block for the garbage collector to walk on every full collection, a pause of
the whole node (see kvtier.deciding.index, and bench/bench_manager.py --pool). A block has an integer id,
reused once it is gone; each tenant's index maps keys to ids in a plain dict (bytes and ints, never
tracked); a region maps its slots to ids in an array; each tenant's recency list per size class is
threaded through two arrays (`Recency`). `Block` is a handle the store hands out (in a `Grant`, an
`Access`, a lease): what never changes for one allocation (tenant, key, region, slot, length,
generation) is copied into it, and the rest (state, busy count, coverage, ...) is read and written
through it in the columns, so a handle kept past its block's end still names that allocation.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvtier._keytable import KeyTable
from kvtier.pool.protocol import ErrorCode, GrantStatus


class BlockState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


_STATES = (BlockState.WRITING, BlockState.READY)
# A block's state in the table's `state` column. (`is` tests, not a dict: an Enum hashes in Python.)
WRITING_CODE, READY_CODE = 0, 1
MAX_TENANTS = 2**16 - 1  # the highest tenant code (a 16-bit tag in the key table)


@dataclass(eq=False, slots=True)
class Region:
    id: int
    base: int  # byte offset in the node's arena
    size: int
    tenant: str | None = None
    slot_bytes: int = 0
    free: array = field(default_factory=lambda: array("i"))  # slots given back, the next one last
    fresh: int = 0  # slots from here on were never handed out since the region was assigned
    num_slots: int = 0
    ids: array | None = None  # slot -> block id (-1: free), while the region is assigned
    num_blocks: int = 0
    num_busy: int = 0
    last_use: int = 0
    last_tenant: str | None = None  # whose bytes the region may still hold (None: zeros only)
    dirty_bytes: int = 0  # bytes from the region's start allocated since it was last zeroed

    def has_room(self) -> bool:
        return bool(self.free) or self.fresh < self.num_slots

    def take_slot(self) -> int:
        """A free slot (one given back first, then the lowest never used); the region has room."""
        if self.free:
            return self.free.pop()
        self.fresh += 1
        return self.fresh - 1

    def block_ids(self) -> list[int]:
        """The ids of the blocks in this region, by slot."""
        return [b for b in self.ids if b >= 0] if self.ids is not None else []


class BlockTable:
    """Every block of a node, as columns indexed by block id. Not thread-safe (the store's caller locks).

    Args:
        regions: the node's regions, by id.

    `keys` is every tenant's index at once: a `KeyTable` (C; see kvtier._keytable) of key -> id
    under the tenant's code as the tag (the same key of two tenants is two blocks), which keeps a
    16-byte key at its id and any other in a dict beside it. Per id: tenant, region, slot, length,
    generation (-1: the id is free), state, mutable, checksum, last use, `busy` (live leases plus
    accesses in flight) and the recency links. What only a WRITING
    block has (its write lease, its coverage: `written`, `islands`) is kept in dicts by id, as
    long as it is WRITING: writes in flight are bounded by the lease limits, blocks are not.
    """

    _GROW = 1024  # ids added to the columns at least at a time (and an eighth of them at most)

    def __init__(self, regions: list[Region]) -> None:
        self.regions = regions
        self.tenant_names: list[str] = []  # by code (see `tenant_code`)
        self._tenant_codes: dict[str, int] = {}
        self.keys = KeyTable()
        self.key_of = self.keys.key_of
        self.islands: dict[int, list[tuple[int, int]]] = {}  # only WRITING blocks written past a gap
        self.written: dict[int, int] = {}  # WRITING blocks with bytes written from their start
        self.write_lease: dict[int, int] = {}  # WRITING blocks' write leases
        self.tenant = array("H")
        self.region = array("i")
        self.slot = array("i")
        self.length = array("I")  # a block fits a region (Slabs: under 4 GiB)
        self.gen = array("q")
        self.state = bytearray()
        self.mutable = bytearray()
        self.checksum = array("Q")
        self.last_use = array("q")
        self.busy = array("i")
        self.prev = array("i")  # recency lists (see `Recency`)
        self.next = array("i")
        self._reuse = array("i")
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.keys)

    def tenant_code(self, tenant: str) -> int:
        """The tenant's number: its tag in `keys` and its value in the `tenant` column."""
        code = self._tenant_codes.get(tenant)
        if code is None:
            if len(self.tenant_names) > MAX_TENANTS:
                raise ValueError(f"a node holds at most {MAX_TENANTS + 1} tenants")
            code = self._tenant_codes[tenant] = len(self.tenant_names)
            self.tenant_names.append(tenant)
        return code

    def find(self, code: int, key: bytes) -> int:
        """The id of tenant `code`'s block under `key`, or -1."""
        return self.keys.find(key, code)

    def add(self, tenant: str, key: bytes, region: Region, slot: int, length: int, gen: int,
            state: BlockState, mutable: bool) -> int:
        """A new block's id, indexed under `key` for `tenant` (who holds none under it), its columns
        set (not busy, nothing written, in no recency list)."""
        code = self.tenant_code(tenant)
        if self._reuse:
            block = self._reuse.pop()
        else:
            block = self._next_id
            self._next_id += 1
            if block == len(self.gen):
                self._grow()
        self.keys.add(key, block, code)
        self.tenant[block], self.region[block], self.slot[block] = code, region.id, slot
        self.length[block], self.gen[block] = length, gen
        self.state[block], self.mutable[block] = READY_CODE if state is BlockState.READY else WRITING_CODE, mutable
        self.checksum[block] = self.last_use[block] = self.busy[block] = 0
        return block

    def remove(self, block: int) -> None:
        """Forgets block `block`: its key leaves the index and its id is reused."""
        self.keys.pop_id(block)
        self.islands.pop(block, None)
        self.written.pop(block, None)
        self.write_lease.pop(block, None)
        self.gen[block] = -1  # a handle kept past the end checks this (see `Block.alive`)
        self._reuse.append(block)

    def _grow(self) -> None:
        more = max(self._GROW, len(self.gen) // 8)  # an eighth: less slack, still amortised O(1)
        for column in (self.tenant, self.region, self.slot, self.length, self.gen, self.checksum, self.last_use,
                       self.busy, self.prev, self.next):
            column.frombytes(bytes(column.itemsize * more))
        self.state.extend(bytes(more))
        self.mutable.extend(bytes(more))


class Recency:
    """One tenant's blocks of one size class, least recently used first: a doubly linked list
    threaded through the table's `prev` / `next` columns (-1: none)."""

    __slots__ = ("_prev", "_next", "head", "tail", "size")

    def __init__(self, table: BlockTable) -> None:
        self._prev, self._next = table.prev, table.next
        self.head = self.tail = -1
        self.size = 0

    def push(self, block: int) -> None:
        """Appends `block` (in no list) as the most recent."""
        tail = self.tail
        self._prev[block], self._next[block] = tail, -1
        if tail >= 0:
            self._next[tail] = block
        else:
            self.head = block
        self.tail = block
        self.size += 1

    def unlink(self, block: int) -> None:
        before, after = self._prev[block], self._next[block]
        if before >= 0:
            self._next[before] = after
        else:
            self.head = after
        if after >= 0:
            self._prev[after] = before
        else:
            self.tail = before
        self.size -= 1

    def move_to_end(self, block: int) -> None:
        """Makes `block` (in this list) the most recent: `unlink` then `push`, inlined (once per hit)."""
        tail = self.tail
        if block == tail:
            return
        prev, nxt = self._prev, self._next
        before, after = prev[block], nxt[block]  # `after` >= 0: the block is not the tail
        if before >= 0:
            nxt[before] = after
        else:
            self.head = after
        prev[after] = before
        prev[block], nxt[block] = tail, -1
        nxt[tail] = block
        self.tail = block

    def move_to_front(self, block: int) -> None:
        """Makes `block` (in this list) the least recent: the next one eviction meets."""
        if block != self.head:
            self.unlink(block)
            head = self.head
            self._prev[block], self._next[block] = -1, head
            if head >= 0:
                self._prev[head] = block
            else:
                self.tail = block
            self.head = block
            self.size += 1

    def __iter__(self) -> Iterator[int]:
        block, nxt = self.head, self._next
        while block >= 0:
            yield block
            block = nxt[block]

    def __len__(self) -> int:
        return self.size


class Block:
    """A handle on one block of a `BlockTable` (see the module's docstring)."""

    __slots__ = ("_table", "id", "tenant", "key", "region", "slot", "length", "gen", "mutable")

    def __init__(self, table: BlockTable, block: int) -> None:
        self._table, self.id = table, block
        self.tenant = table.tenant_names[table.tenant[block]]
        self.key = table.key_of(block)
        self.region = table.regions[table.region[block]]
        self.slot, self.length, self.gen = table.slot[block], table.length[block], table.gen[block]
        self.mutable = bool(table.mutable[block])

    # What changes during an allocation, in the table's columns (spelled out: a generic
    # property by column name cost a getattr per access, on the node's per-request path).

    @property
    def checksum(self) -> int:
        return self._table.checksum[self.id]

    @checksum.setter
    def checksum(self, value: int) -> None:
        self._table.checksum[self.id] = value

    @property
    def last_use(self) -> int:
        return self._table.last_use[self.id]

    @last_use.setter
    def last_use(self, value: int) -> None:
        self._table.last_use[self.id] = value

    @property
    def written(self) -> int:
        """Bytes written from the block's start (while WRITING; see `cover`)."""
        return self._table.written.get(self.id, 0)

    @written.setter
    def written(self, value: int) -> None:
        self._table.written[self.id] = value

    @property
    def write_lease(self) -> int:
        """The write lease of a WRITING block (0: none)."""
        return self._table.write_lease.get(self.id, 0)

    @write_lease.setter
    def write_lease(self, value: int) -> None:
        self._table.write_lease[self.id] = value

    @property
    def state(self) -> BlockState:
        return _STATES[self._table.state[self.id]]

    @state.setter
    def state(self, value: BlockState) -> None:
        self._table.state[self.id] = READY_CODE if value is BlockState.READY else WRITING_CODE

    @property
    def islands(self) -> list[tuple[int, int]] | None:
        """Written ranges past a gap, sorted and disjoint (while WRITING; see `cover`)."""
        return self._table.islands.get(self.id)

    @islands.setter
    def islands(self, value: list[tuple[int, int]] | None) -> None:
        if value:
            self._table.islands[self.id] = value
        else:
            self._table.islands.pop(self.id, None)

    @property
    def alive(self) -> bool:
        """Whether this allocation still holds its slot (a handle may outlive it)."""
        return self._table.gen[self.id] == self.gen

    @property
    def busy(self) -> bool:
        """Whether a lease or an access in flight holds the block (never evicted, deleted or reused)."""
        return self._table.busy[self.id] > 0

    @property
    def offset(self) -> int:
        """Byte offset of the block in its region."""
        return self.slot * self.region.slot_bytes

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Block) and other._table is self._table and (other.id, other.gen) == (self.id, self.gen)

    def __hash__(self) -> int:
        return hash((self.id, self.gen))

    def __repr__(self) -> str:
        return f"Block({self.tenant!r}, {self.key!r}, region {self.region.id} slot {self.slot}, gen {self.gen})"


@dataclass(eq=False, slots=True)
class TenantState:
    quota_bytes: int
    counters: dict[str, int]  # this tenant's own events (what its STATS shows)
    code: int  # its tag in the table's key index (`BlockTable.tenant_code`)
    used_bytes: int = 0
    num_blocks: int = 0
    lru: dict[int, Recency] = field(default_factory=dict)  # slot_bytes -> its blocks, oldest first
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
    table, i = block._table, block.id  # the columns, not the handle's properties: once per write
    written = table.written.get(i, 0)
    if start > written:
        islands = table.islands.get(i) or []
        if len(islands) < MAX_WRITE_ISLANDS:
            table.islands[i] = _merged(islands, start, end)
        return
    written = max(written, end)
    islands = table.islands.get(i)
    if islands:
        while islands and islands[0][0] <= written:
            written = max(written, islands.pop(0)[1])
        if not islands:
            del table.islands[i]
    table.written[i] = written


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
