"""Belady's MIN as an `EvictionPolicy`: the offline optimum that bounds every online policy.

Belady evicts the block whose next use lies farthest in the future. That needs the future, which a
trace replay has: `FutureAccesses` is built from the whole access sequence (every hash id of every
request, in order) and is told by the simulator which request is being served
(`begin_request`). `BeladyPolicy` runs inside the *same* `TierManager` as the online policies — it
is a policy object like LRU, not a separate replay — so its hit rate is measured exactly as theirs.

Why it is an upper bound only for a single tier: with one tier, every miss is stored and every
store evicts one block, which is the demand-paging setting in which MIN is optimal, so no policy
serving the same requests through the same manager can hit more often. With several tiers each
tier runs its own MIN on what reaches it, which is a good heuristic but not a bound.

Time is the position in the flattened access sequence. A key's priority is its next position after
the access that last touched or inserted it. Equal priorities (only "never used again") evict the
most recently recorded key first. A resident key that was accessed without the manager touching it
(a block cached beyond a request's matched prefix) has a priority in the past: `evict` refreshes
it from the oracle before using it.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Sequence

from kvtier.policy.base import EvictionPolicy


class FutureAccesses:
    """The access sequence known in advance, and where the replay is in it."""

    def __init__(self, requests: Sequence[Sequence[Hashable]]) -> None:
        """Indexes every request's keys, in order.

        Args:
            requests: the keys each request accesses, in replay order.
        """
        starts: list[int] = []
        flat: list[Hashable] = []
        for keys in requests:
            starts.append(len(flat))
            flat.extend(keys)
        self.never = len(flat)  # the next use of a key that is never used again
        following = [self.never] * len(flat)
        seen: dict[Hashable, int] = {}
        for pos in range(len(flat) - 1, -1, -1):
            key = flat[pos]
            following[pos] = seen.get(key, self.never)
            seen[key] = pos
        self._first = seen  # key -> its first position
        self._requests = requests
        self._starts = starts
        self._following = following
        self.upcoming: dict[Hashable, int] = {}  # key -> next use after its latest access so far (read-only)
        self.now = 0  # the first position after the request being served

    def begin_request(self, index: int) -> None:
        """Moves the present to request `index` (0-based): its keys count as accessed now."""
        start = self._starts[index]
        keys = self._requests[index]
        end = start + len(keys)
        self.upcoming.update(zip(keys, self._following[start:end]))
        self.now = end

    def next_use(self, key: Hashable) -> int:
        """The position of `key`'s next access after the present, or `never`."""
        nxt = self.upcoming.get(key)
        if nxt is None:  # not accessed yet
            nxt = self._first.get(key, self.never)
        return nxt


class BeladyPolicy(EvictionPolicy):
    """Evicts the resident key whose next access is farthest away (Belady's MIN)."""

    def __init__(self, future: FutureAccesses) -> None:
        """Creates an empty policy reading next uses from `future`."""
        self._future = future
        self._seq: dict[Hashable, int] = {}  # resident key -> sequence number of its live heap entry
        self._heap: list[tuple[int, int, Hashable]] = []  # (-next use, -seq, key); stale entries skipped
        self._counter = 0
        self._compact_at = 1024  # heap length that triggers dropping superseded entries

    def insert(self, key: Hashable) -> None:
        """Records that `key` became resident.

        Raises:
            KeyError: `key` is already tracked.
        """
        if key in self._seq:
            raise KeyError(key)
        self._record(key)

    def touch(self, key: Hashable) -> None:
        """Re-reads `key`'s next use after this access. Unknown keys are ignored."""
        if key not in self._seq:
            return
        # `_record`, inlined: once per hit. The oracle's dict is read directly.
        nxt = self._future.upcoming.get(key)
        if nxt is None:
            nxt = self._future.next_use(key)
        self._counter = seq = self._counter + 1
        self._seq[key] = seq
        heapq.heappush(self._heap, (-nxt, -seq, key))
        if len(self._heap) > self._compact_at:
            self._compact()

    def remove(self, key: Hashable) -> None:
        """Forgets `key`. Unknown keys are ignored."""
        self._seq.pop(key, None)

    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Chooses the `n` unprotected keys used farthest in the future and forgets them."""
        if n == 1:  # the hot path, one victim per store into a full tier: try the farthest first
            item = self._pop_live()
            if item is None:
                return None
            free = False
            try:
                free = not protected(item[2])
            finally:
                if not free:  # protected, or `protected` raised: put it back
                    heapq.heappush(self._heap, item)
            if free:
                del self._seq[item[2]]
                return [item[2]]
        taken: list[tuple[int, int, Hashable]] = []  # popped live entries: victims and set-asides
        victims: list[Hashable] = []
        try:
            while len(victims) < n:
                item = self._pop_live()
                if item is None:
                    break
                taken.append(item)
                if not protected(item[2]):
                    victims.append(item[2])
        finally:
            if len(victims) < n:  # too few, or `protected` raised: put everything back
                victims = []
            for item in taken:
                if item[2] not in victims:
                    heapq.heappush(self._heap, item)
        if not victims:
            return None
        for key in victims:
            del self._seq[key]
        return victims

    def _record(self, key: Hashable) -> None:
        # The hot path (once per store): the oracle's dict is read directly.
        nxt = self._future.upcoming.get(key)
        if nxt is None:
            nxt = self._future.next_use(key)
        self._counter = seq = self._counter + 1
        self._seq[key] = seq
        heap = self._heap
        heapq.heappush(heap, (-nxt, -seq, key))
        if len(heap) > self._compact_at:
            self._compact()

    def _pop_live(self) -> tuple[int, int, Hashable] | None:
        """Pops the live entry with the farthest next use, refreshing any whose use has passed."""
        heap, seq, now = self._heap, self._seq, self._future.now
        while heap:
            item = heapq.heappop(heap)
            key = item[2]
            if seq.get(key) != -item[1]:
                continue  # superseded by a later touch, or removed
            if -item[0] < now:  # used since it was recorded, without a touch: re-read
                # (clamped: a key repeated within the request being served is needed now)
                heapq.heappush(heap, (-max(self._future.next_use(key), now), item[1], key))
                continue
            return item
        return None

    def _compact(self) -> None:
        """Drops superseded heap entries (they pile up with touches)."""
        seq = self._seq
        self._heap = [item for item in self._heap if seq.get(item[2]) == -item[1]]
        heapq.heapify(self._heap)
        self._compact_at = 2 * len(self._heap) + 1024

    def __contains__(self, key: Hashable) -> bool:
        return key in self._seq

    def __len__(self) -> int:
        return len(self._seq)
