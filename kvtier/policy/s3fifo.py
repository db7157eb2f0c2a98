"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP'23).

Three FIFO queues: a small one that new keys enter, a main one for keys that proved themselves, and
a ghost queue remembering keys recently evicted from the small queue. A key found in the ghost on
insert goes straight to main. Touches bump a frequency that saturates at `max_freq`.

Evicting, when the small queue holds at least its target share (or main is empty), pops the small
queue's oldest key: if it was touched it moves to main with its frequency cleared, as in the paper,
otherwise it is the victim and its key enters the ghost. Otherwise main's oldest key is popped: if
its frequency is above zero it is reinserted with the frequency decremented (a 2-bit CLOCK),
otherwise it is the victim. Only a victim is checked against `protected`: a protected key
that would have been the victim is set aside and put back at the old end of its queue afterwards, so
it keeps its place.

Which S3-FIFO this is. The paper's (libCacheSim's S3FIFOv0.c) with a move-to-main threshold of one
touch: every new key enters small (main only from the ghost), and a small-queue key touched once or
more goes to main when it reaches the old end. libCacheSim's default `S3FIFO` (S3FIFO.c, and the
`libcachesim` 0.3.5 Python binding) differs in two ways: while the cache is not yet full but small
is, it inserts new keys into main, and its binding promotes only keys touched twice
(`move_to_main_threshold=2`). Replayed on the Mooncake conversation trace at 18,279 blocks it hits
22.5 % of block accesses (22.7 % with threshold 1), this policy 24.4 % in `kvtier simulate` (whose
hits count only inside a request's matched prefix; libCacheSim counts every cached block).

Why undo rather than a dry run: an eviction reorders main and moves keys between queues before it
finds a victim, so predicting the outcome means re-running the algorithm. Instead every step is
journaled, and when too few victims exist (rare, and already O(resident keys)) the journal is
replayed backwards, leaving the state exactly as it was.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable

from kvtier._keytable import KeyList
from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy

# Oldest first. A KeyList (C) does what an OrderedDict did, with nothing per key for the garbage
# collector to walk; in small and main each key's value is its frequency (so a resident key is kept
# once, in its queue), in the ghost queue it is unused.
_Queue = KeyList

# Journal records, undone in reverse order.
_POP = 0  # (_POP, queue, key): key popped from the old end of queue (a victim or set aside)
_SMALL_TO_MAIN = 1  # (_SMALL_TO_MAIN, key, freq): moved from small to main, freq cleared
_MAIN_REINSERT = 2  # (_MAIN_REINSERT, key): moved from main's old end to its new end, freq - 1


class S3FIFOPolicy(EvictionPolicy):
    """Small/main/ghost FIFO queues: scan-resistant, and cheap on touch."""

    def __init__(
        self,
        capacity_hint: int,
        small_ratio: float = 0.1,
        ghost_ratio: float = 0.9,
        max_freq: int = 3,
    ) -> None:
        """Creates an empty policy.

        Args:
            capacity_hint: expected number of resident keys; sizes the small and ghost queues only.
            small_ratio: share of `capacity_hint` the small queue aims to hold, in (0, 1).
            ghost_ratio: ghost entries kept, as a share of `capacity_hint` (>= 0).
            max_freq: saturation value of the per-key access counter, in [1, 255].
        Raises:
            ConfigError: a parameter is out of range; the message names it.
        """
        _check_int("capacity_hint", capacity_hint, minimum=1)
        _check_int("max_freq", max_freq, minimum=1, maximum=255)
        _check_ratio("small_ratio", small_ratio, open_top=True)
        _check_ratio("ghost_ratio", ghost_ratio, open_top=False)
        self._small_target = max(1, round(capacity_hint * small_ratio))
        self._ghost_size = round(capacity_hint * ghost_ratio)
        self._max_freq = max_freq
        self._small: _Queue = KeyList()
        self._main: _Queue = KeyList()
        self._ghost: _Queue = KeyList()

    def insert(self, key: Hashable) -> None:
        """Records that `key` became resident: into main if it is a ghost, else into small.

        Raises:
            KeyError: `key` is already tracked.
        """
        if key in self._small or key in self._main:
            raise KeyError(key)
        if self._ghost.pop(key, _MISSING) is _MISSING:
            self._small[key] = 0
        else:
            self._main[key] = 0

    def touch(self, key: Hashable) -> None:
        """Counts an access to a resident `key`, up to `max_freq`. Unknown keys are ignored."""
        queue = self._small
        f = queue.get(key)
        if f is None:
            queue = self._main
            f = queue.get(key)
        if f is not None and f < self._max_freq:
            queue[key] = f + 1  # its place in the queue stays

    def remove(self, key: Hashable) -> None:
        """Forgets `key` without remembering it as a ghost. Unknown keys are ignored."""
        if self._small.pop(key, _MISSING) is _MISSING:
            self._main.pop(key, None)

    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Chooses `n` victims by the S3-FIFO rules and forgets them."""
        journal: list[tuple] = []
        aside_small: list[Hashable] = []
        aside_main: list[Hashable] = []
        victims: list[tuple[_Queue, Hashable]] = []
        try:
            for _ in range(n):
                victim = self._next_victim(protected, journal, aside_small, aside_main)
                if victim is None:
                    self._undo(journal)
                    return None
                victims.append(victim)
        except BaseException:  # `protected` raised: leave things as they were, then re-raise
            self._undo(journal)
            raise
        if aside_small:
            _put_back(self._small, aside_small)
        if aside_main:
            _put_back(self._main, aside_main)
        return self._commit(victims)

    def evict_one(self, protected: Callable[[Hashable], bool]) -> Hashable | None:
        """`evict(1, protected)`'s victim, or None: the hot path of a full tier, without the lists."""
        journal: list[tuple] = []
        aside_small: list[Hashable] = []
        aside_main: list[Hashable] = []
        try:
            victim = self._next_victim(protected, journal, aside_small, aside_main)
        except BaseException:  # `protected` raised: leave things as they were, then re-raise
            self._undo(journal)
            raise
        if victim is None:
            self._undo(journal)
            return None
        if aside_small:
            _put_back(self._small, aside_small)
        if aside_main:
            _put_back(self._main, aside_main)
        queue, key = victim
        if queue is self._small:
            self._remember(key)
        return key

    def _next_victim(
        self,
        protected: Callable[[Hashable], bool],
        journal: list[tuple],
        aside_small: list[Hashable],
        aside_main: list[Hashable],
    ) -> tuple[_Queue, Hashable] | None:
        """Pops the next victim and its queue, or returns None once both queues are exhausted."""
        small, main = self._small, self._main
        while small or main:
            # Set-aside keys still occupy the small queue, so they count toward its share.
            if small and (not main or len(small) + len(aside_small) >= self._small_target):
                victim = self._evict_small(protected, journal, aside_small)
            else:
                victim = self._evict_main(protected, journal, aside_main)
            if victim is not None:
                return victim
        return None

    def _evict_small(
        self, protected: Callable[[Hashable], bool], journal: list[tuple], aside: list[Hashable]
    ) -> tuple[_Queue, Hashable] | None:
        """Pops small until a victim appears (returned) or small is empty (None)."""
        small, main = self._small, self._main
        while small:
            key, f = small.popitem(last=False)
            if f > 0:
                main[key] = 0
                journal.append((_SMALL_TO_MAIN, key, f))
                continue
            journal.append((_POP, small, key))
            if not protected(key):
                return small, key
            aside.append(key)
        return None

    def _evict_main(
        self, protected: Callable[[Hashable], bool], journal: list[tuple], aside: list[Hashable]
    ) -> tuple[_Queue, Hashable] | None:
        """Pops main until a victim appears (returned) or main is empty (None)."""
        main = self._main
        while main:
            key, f = main.popitem(last=False)
            if f > 0:
                main[key] = f - 1
                journal.append((_MAIN_REINSERT, key))
                continue
            journal.append((_POP, main, key))
            if not protected(key):
                return main, key
            aside.append(key)
        return None

    def _undo(self, journal: list[tuple]) -> None:
        """Replays `journal` backwards, restoring the state from before the eviction began."""
        small, main = self._small, self._main
        for record in reversed(journal):
            op = record[0]
            if op == _POP:  # a key popped with frequency 0 (only those are candidates)
                _put_back(record[1], [record[2]])
            elif op == _MAIN_REINSERT:
                key = record[1]
                main.move_to_end(key, last=False)
                main[key] += 1
            else:  # _SMALL_TO_MAIN
                key = record[1]
                del main[key]
                _put_back(small, [key])
                small[key] = record[2]

    def _commit(self, victims: list[tuple[_Queue, Hashable]]) -> list[Hashable]:
        """Forgets the victims; those evicted from small are remembered in the ghost queue."""
        small = self._small
        keys: list[Hashable] = []
        for queue, key in victims:  # already popped from their queue
            keys.append(key)
            if queue is small:
                self._remember(key)
        return keys

    def _remember(self, key: Hashable) -> None:
        """Puts a victim evicted from small into the ghost queue (bounded by `ghost_ratio`)."""
        if self._ghost_size > 0:
            ghost = self._ghost
            ghost[key] = None
            if len(ghost) > self._ghost_size:
                ghost.popitem(last=False)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._small or key in self._main

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


_MISSING = object()


def _put_back(queue: _Queue, keys: list[Hashable]) -> None:
    """Reinserts `keys` (popped oldest first) at the old end of `queue`, in their original order."""
    for key in reversed(keys):
        queue[key] = 0  # a candidate, popped with frequency 0
        queue.move_to_end(key, last=False)


def _check_int(name: str, value: object, *, minimum: int, maximum: int | None = None) -> None:
    """Raises ConfigError naming `name` unless `value` is an int in [minimum, maximum]."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (maximum is not None and value > maximum):
        bounds = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ConfigError(f"s3fifo.{name} must be an integer {bounds}, got {value!r}")


def _check_ratio(name: str, value: object, *, open_top: bool) -> None:
    """Raises ConfigError naming `name` unless `value` is a finite number in (0, 1), or >= 0."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    in_range = is_number and math.isfinite(value) and (0 < value < 1 if open_top else value >= 0)
    if not in_range:
        bounds = "in (0, 1)" if open_top else ">= 0"
        raise ConfigError(f"s3fifo.{name} must be a finite number {bounds}, got {value!r}")
