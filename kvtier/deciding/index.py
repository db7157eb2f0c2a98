"""The block index: key -> where each copy lives, its state, pins and checksums.

Pure bookkeeping; no I/O, no policy. The manager is the only writer.

A block may have one copy per tier (several only in inclusive mode or while moving). Each copy is
`WRITING` (bytes on their way: invisible to lookups, never read), `READY`, or `FREEING` (leaving,
kept only until its last in-flight reader ends). A copy being read has `readers > 0` and cannot be
evicted; a block with `pins > 0` cannot be evicted anywhere.

Storage: columns, not objects. An engine's process and a pool node index millions of blocks, and
the garbage collector walks every object it tracks on each full collection, a pause of the whole
server (about 180 ns per object: 550 ms for the three objects per block this used to keep). So no
per-block object here is one the collector tracks:
  * each indexed key gets an integer id, reused once the block leaves: `ids` maps keys to ids and
    back (`key_of`) in a `kvtier._keytable.KeyTable` (C), which keeps a 16-byte digest (`BlockKey`)
    or a 64-bit int (a simulation's hash id) as 16 bytes at its id, with its hash, in an
    open-addressing table of ids, ~37 bytes a block, where a dict took ~140 (a bytes object per key, an int object per id,
    its own table); other keys it keeps in a dict on the side;
  * per id, arrays (`array.array`, `bytearray`: 1–4 bytes an item, and one object however long,
    which the collector walks in constant time: it never looks at the items) hold the slot of its
    copy in each tier (-1: none), its pins, hits, fastest READY tier and the prefetched flag;
  * per tier and slot, arrays hold the id owning the slot (-1: free), the copy's state and readers.
A block has at least one copy and a copy holds one slot, so ids never outnumber the slots of all
tiers together: the per-slot columns are allocated once, the per-id ones grow (in place, by a
quarter) up to that bound as ids are handed out. `get` and iteration build `BlockEntry` snapshots
from the columns, for inspection and tests; the manager's paths read the columns directly.
"""

from __future__ import annotations

import enum
from array import array
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from kvtier._keytable import KeyTable
from kvtier.errors import CapacityError, KVTierError
from kvtier.kinds import TierKind


class CopyState(enum.Enum):
    WRITING = "writing"  # bytes on their way in: invisible, unreadable, not evictable
    READY = "ready"  # servable
    FREEING = "freeing"  # leaving: invisible to new readers, freed when the last reader ends


# A copy's state in the `state` columns; FREE: the slot holds no copy.
FREE, WRITING, READY, FREEING = 0, 1, 2, 3
NO_TIER = 255  # the `ready` column of a block with no READY copy
_STATES = (None, CopyState.WRITING, CopyState.READY, CopyState.FREEING)
_KINDS = tuple(TierKind)


@dataclass(slots=True)
class Copy:
    """One copy of a block in one tier (a snapshot: see `BlockIndex.get`)."""

    slot: int
    state: CopyState = CopyState.WRITING
    readers: int = 0  # in-flight reads (loads, or the source side of a move)

    @property
    def evictable(self) -> bool:
        return self.state is CopyState.READY and self.readers == 0


@dataclass(slots=True)
class BlockEntry:
    """Everything the index knows of one block, copied out of its columns (changing it changes nothing)."""

    key: Hashable
    copies: dict[TierKind, Copy] = field(default_factory=dict)
    pins: int = 0
    hits: int = 0
    checksums: tuple[int, ...] | None = None  # per layer, xxh3_64 of the layer's bytes
    prefetched: bool = False  # brought up by a prefetch and not loaded since
    ready_tier: TierKind | None = None  # the fastest READY copy

    def best_ready(self) -> TierKind | None:
        """The fastest tier holding a READY copy, or None."""
        return self.ready_tier

    def live_copies(self) -> int:
        """Copies that are or will become servable (READY or WRITING)."""
        return sum(c.state is not CopyState.FREEING for c in self.copies.values())


class SlotAllocator:
    """A free list over `num_slots` fixed slots of one tier.

    `free` is the array itself, never rebound: the manager's per-block paths pop and append it
    directly (`slot = free.pop() if free else None` is `allocate()` without a Python call; a
    three-tier replay claims ~3 slots per block access), so the count in use is derived from it.
    An `array`, not a list: 4 bytes a slot, and no item for the garbage collector to walk.
    """

    def __init__(self, kind: TierKind, num_slots: int) -> None:
        if num_slots < 1:
            raise CapacityError(f"tier {kind.name}: needs at least one slot, got {num_slots}")
        if num_slots >= 2**31:
            raise CapacityError(f"tier {kind.name}: at most 2**31 - 1 slots, got {num_slots}")
        self.kind = kind
        self.num_slots = num_slots
        self.free = array("i", range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self.free)

    @property
    def num_free(self) -> int:
        return len(self.free)

    def allocate(self) -> int | None:
        """A free slot, or None when the tier is full."""
        return self.free.pop() if self.free else None

    def take(self, slots: set[int]) -> None:
        """Marks `slots` (all free) as used, e.g. for blocks found on disk at start-up."""
        self.free[:] = array("i", [s for s in self.free if s not in slots])

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise KVTierError(f"tier {self.kind.name}: released slot {slot} out of range")
        self.free.append(slot)


class BlockIndex:
    """Keys to ids, and the columns of every indexed block: the manager's single source of truth.

    Args:
        num_slots: the slots of each configured tier.

    Per id (`ids[key]`): `slot[tier][id]` (-1: no copy there), `pins[id]`, `hits[id]`,
    `ready[id]` (the fastest READY tier's number, `NO_TIER`: none), `prefetched[id]`,
    `num_copies[id]`, and `checksums` (a dict, id -> per-layer checksums, for blocks that have them).
    Per tier and slot: `owner[tier][slot]` (the id, -1: free), `state[tier][slot]` (FREE, WRITING,
    READY, FREEING), `readers[tier][slot]`. Lists indexed by tier hold None for a tier not configured.
    """

    def __init__(self, num_slots: Mapping[TierKind, int]) -> None:
        capacity = sum(num_slots.values())
        self.capacity = capacity  # ids in use never exceed it: each indexed block holds a slot
        self.ids = KeyTable()  # key -> id, as a dict of them would (see the module's docstring)
        self.key_of: Callable[[int], Hashable] = self.ids.key_of
        self.checksums: dict[int, tuple] = {}
        self._reuse = array("i")  # ids of blocks gone, handed out again first
        self._next_id = 0
        self._allocated = 0  # length of the per-id columns
        self.pins = array("i")
        self.hits = array("i")
        self.ready = bytearray()
        self.prefetched = bytearray()
        self.num_copies = bytearray()  # at most one copy per tier: never above 4
        tiers = len(_KINDS)
        self.slot: list[array | None] = [None] * tiers
        self.owner: list[array | None] = [None] * tiers
        self.state: list[bytearray | None] = [None] * tiers
        self.readers: list[array | None] = [None] * tiers
        for kind, n in num_slots.items():
            self.slot[kind] = array("i")
            self.owner[kind] = array("i", [-1]) * n
            self.state[kind] = bytearray(n)
            self.readers[kind] = array("i", bytes(4 * n))
        self._kinds = tuple(sorted(num_slots))

    def add(self, key: Hashable) -> int:
        """Indexes `key` (not indexed yet) with no copy; returns its id."""
        reuse = self._reuse
        if reuse:
            block = reuse.pop()
        else:
            block = self._next_id
            if block == self._allocated:
                self._grow()
            self._next_id = block + 1
        self.ids[key] = block
        return block

    def add_many(self, keys: Sequence[Hashable]) -> array:
        """Indexes `keys` (none indexed yet, each once) with no copy; returns their ids."""
        n, reuse = len(keys), self._reuse
        taken = min(n, len(reuse))
        fresh = n - taken
        while self._next_id + fresh > self._allocated:
            self._grow()
        ids = reuse[len(reuse) - taken:]
        ids.reverse()  # the order `add` pops them in
        del reuse[len(reuse) - taken:]
        ids.extend(range(self._next_id, self._next_id + fresh))
        self._next_id += fresh
        table = self.ids
        for key, block in zip(keys, ids):
            table[key] = block
        return ids

    def forget(self, blocks: array) -> None:
        """`remove`'s bookkeeping for blocks whose key and columns `ResidentPath.evict` cleared."""
        if self.checksums:
            for block in blocks:
                self.checksums.pop(block, None)
        self._reuse.extend(blocks)

    def remove(self, block: int) -> None:
        """Forgets block `block` (it holds no copy any more); its id is reused."""
        self.ids.pop_id(block)
        # Its pins are 0 and its `ready` NO_TIER already: a block with no copy has neither.
        self.hits[block] = 0
        self.prefetched[block] = 0
        if self.checksums:
            self.checksums.pop(block, None)
        self._reuse.append(block)

    def _grow(self) -> None:
        """Lengthens every per-id column by a quarter (at least 1024 ids), in place, up to `capacity`."""
        old = self._allocated
        more = min(self.capacity, max(old + 1024, old + old // 4)) - old
        if more <= 0:
            raise KVTierError(f"the index is full ({self.capacity} blocks): a block without a copy was kept")
        for column in (self.pins, self.hits):
            column.extend(array("i", bytes(4 * more)))
        self.ready.extend(bytes([NO_TIER]) * more)
        self.prefetched.extend(bytes(more))
        self.num_copies.extend(bytes(more))
        for kind in self._kinds:
            self.slot[kind].extend(array("i", [-1]) * more)
        self._allocated = old + more

    # ---- inspection ------------------------------------------------------------------------

    def get(self, key: Hashable) -> BlockEntry | None:
        """A snapshot of what the index holds for `key`, or None."""
        block = self.ids.get(key)
        return None if block is None else self._snapshot(block)

    def _snapshot(self, block: int) -> BlockEntry:
        copies = {}
        for kind in self._kinds:
            slot = self.slot[kind][block]
            if slot >= 0:
                copies[kind] = Copy(slot, _STATES[self.state[kind][slot]], self.readers[kind][slot])
        ready = self.ready[block]
        return BlockEntry(self.key_of(block), copies, self.pins[block], self.hits[block],
                          self.checksums.get(block), bool(self.prefetched[block]),
                          None if ready == NO_TIER else _KINDS[ready])

    def __contains__(self, key: Hashable) -> bool:
        return key in self.ids

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter([self._snapshot(block) for block in self.ids.values()])
