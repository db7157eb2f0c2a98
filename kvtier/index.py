"""The block index: key -> where each copy lives, its state, pins and checksums.

Pure bookkeeping; no I/O, no policy. The manager is the only writer.

A block may have one copy per tier (several only in inclusive mode or while moving). Each copy is
`WRITING` (bytes on their way: invisible to lookups, never read), `READY`, or `FREEING` (leaving,
kept only until its last in-flight reader ends). A copy being read has `readers > 0` and cannot be
evicted; a block with `pins > 0` cannot be evicted anywhere.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

from kvtier.errors import CapacityError, KVTierError
from kvtier.kinds import TierKind


class CopyState(enum.Enum):
    WRITING = "writing"  # bytes on their way in: invisible, unreadable, not evictable
    READY = "ready"  # servable
    FREEING = "freeing"  # leaving: invisible to new readers, freed when the last reader ends


@dataclass(slots=True)
class Copy:
    """One copy of a block in one tier."""

    slot: int
    state: CopyState = CopyState.WRITING
    readers: int = 0  # in-flight reads (loads, or the source side of a move)

    @property
    def evictable(self) -> bool:
        return self.state is CopyState.READY and self.readers == 0


@dataclass(slots=True)
class BlockEntry:
    key: Hashable
    copies: dict[TierKind, Copy] = field(default_factory=dict)
    pins: int = 0
    hits: int = 0
    checksums: tuple[int, ...] | None = None  # per layer, xxh3_64 of the layer's bytes
    prefetched: bool = False  # brought up by a prefetch and not loaded since
    ready_tier: TierKind | None = None  # the fastest READY copy; kept by `refresh()` on every state change

    def best_ready(self) -> TierKind | None:
        """The fastest tier holding a READY copy, or None."""
        return self.ready_tier  # cached: lookups run once per key and dominate bookkeeping

    def refresh(self) -> None:
        """Recomputes `ready_tier`; call after any copy's state changes."""
        best = None
        for tier, copy in self.copies.items():
            if copy.state is _READY and (best is None or tier < best):
                best = tier
        self.ready_tier = best

    def live_copies(self) -> int:
        """Copies that are or will become servable (READY or WRITING)."""
        n = 0
        for copy in self.copies.values():
            if copy.state is not _FREEING:
                n += 1
        return n


_READY = CopyState.READY
_FREEING = CopyState.FREEING


class SlotAllocator:
    """A free list over `num_slots` fixed slots of one tier.

    `free` is the list itself, never rebound: the manager's per-block paths pop and append it
    directly (`slot = free.pop() if free else None` is `allocate()` without a Python call; a
    three-tier replay claims ~3 slots per block access), so the count in use is derived from it.
    """

    def __init__(self, kind: TierKind, num_slots: int) -> None:
        if num_slots < 1:
            raise CapacityError(f"tier {kind.name}: needs at least one slot, got {num_slots}")
        self.kind = kind
        self.num_slots = num_slots
        self.free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first

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
        self.free[:] = [s for s in self.free if s not in slots]

    def release(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise KVTierError(f"tier {self.kind.name}: released slot {slot} out of range")
        self.free.append(slot)


class BlockIndex:
    """Maps keys to entries; the manager's single source of truth."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, BlockEntry] = {}
        # The manager calls `get` several times per block access: binding the dict's own method
        # saves a Python frame per call (see bench/bench_simulate.py). Same contract as `get` below.
        self.get = self._entries.get

    def get(self, key: Hashable) -> BlockEntry | None:  # shadowed per instance by __init__
        """The entry of `key`, or None."""
        return self._entries.get(key)

    def get_or_create(self, key: Hashable) -> BlockEntry:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = BlockEntry(key)
        return entry

    def discard(self, key: Hashable) -> None:
        self._entries.pop(key, None)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[BlockEntry]:
        return iter(list(self._entries.values()))
