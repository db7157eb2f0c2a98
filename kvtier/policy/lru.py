"""Least-recently-used eviction: the default policy of every tier.

Two implementations of one order:
  * `SlotLRUPolicy`, what `make_policy` builds for the manager, which hands its policies slot
    numbers (`tracks_slots`): a doubly linked list threaded through two arrays indexed by slot
    (`array.array`, 4 bytes a link), oldest at the head. Nothing per key is an object, so a full
    garbage collection has nothing to walk (see kvtier.index); keys must be integers >= 0, dense
    as slot numbers are (the arrays grow to the largest seen); a bool counts as 0 or 1.
  * `LRUPolicy`, for any hashable keys: one `OrderedDict` ordered from least to most recent, which
    keeps a node per key.
Both: insert, touch and remove are O(1); evicting `n` victims walks from the least recent end and
costs O(n + number of protected keys skipped).
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvtier.policy.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evicts the least recently inserted-or-touched unprotected key first."""

    __slots__ = ("_order",)

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        """Records that `key` became resident, as the most recent key.

        Raises:
            KeyError: `key` is already tracked.
        """
        order = self._order
        if key in order:
            raise KeyError(key)
        order[key] = None

    def touch(self, key: Hashable) -> None:
        """Makes a resident `key` the most recent. Unknown keys are ignored."""
        try:
            self._order.move_to_end(key)
        except KeyError:
            pass  # a miss is not an error

    def remove(self, key: Hashable) -> None:
        """Forgets `key`. Unknown keys are ignored."""
        self._order.pop(key, None)

    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Chooses the `n` least recent unprotected keys and forgets them."""
        order = self._order
        if n == 1:  # the hot path: one victim per block stored into a full tier
            for key in order:
                if not protected(key):
                    del order[key]  # ends the loop: the iterator is not advanced again
                    return [key]
            return None
        victims = self._least_recent_unprotected(n, protected)
        if victims is None:
            return None
        for key in victims:
            del order[key]
        return victims

    def _least_recent_unprotected(
        self, n: int, protected: Callable[[Hashable], bool]
    ) -> list[Hashable] | None:
        """Returns the `n` least recent unprotected keys (n >= 1) without changing anything."""
        victims: list[Hashable] = []
        for key in self._order:
            if not protected(key):
                victims.append(key)
                if len(victims) == n:
                    return victims
        return None

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)


_OUT = -2  # `_prev` of a key not tracked
_END = -1  # no neighbour


class SlotLRUPolicy(EvictionPolicy):
    """`LRUPolicy` over integer keys (slot numbers), in two arrays: see the module's docstring."""

    __slots__ = ("_prev", "_next", "_head", "_tail", "_len")
    tracks_slots = True  # the manager may hand it slot numbers as they are

    def __init__(self, capacity_hint: int = 0) -> None:
        size = max(0, int(capacity_hint))
        self._prev = array("i", [_OUT]) * size
        self._next = array("i", [_END]) * size
        self._head = self._tail = _END  # least and most recent key
        self._len = 0

    def insert(self, key: int) -> None:
        """Records that `key` became resident, as the most recent key.

        Raises:
            KeyError: `key` is already tracked.
            TypeError: `key` is not an integer >= 0.
        """
        prev = self._prev
        try:
            tracked = prev[key] != _OUT
        except (IndexError, TypeError):  # past the arrays (they grow), or not an integer (refused)
            self._grow(key)  # in place: `prev` is still the array
            tracked = False
        if tracked or key < 0:
            raise KeyError(key) if key >= 0 else TypeError(f"SlotLRUPolicy tracks slot numbers (integers >= 0), got {key!r}")
        tail = self._tail
        prev[key] = tail
        if tail >= 0:
            self._next[tail] = key
        else:
            self._head = key
        self._next[key] = _END
        self._tail = key
        self._len += 1

    def touch(self, key: int) -> None:
        """Makes a resident `key` the most recent. Unknown keys are ignored."""
        if key == self._tail:
            return
        prev = self._prev
        try:
            before = prev[key]
        except (IndexError, TypeError):
            return  # a miss is not an error
        if before == _OUT or key < 0:
            return
        nxt = self._next
        after = nxt[key]  # not _END: key is not the tail
        if before >= 0:
            nxt[before] = after
        else:
            self._head = after
        prev[after] = before
        tail = self._tail
        prev[key] = tail
        nxt[key] = _END
        nxt[tail] = key
        self._tail = key

    def remove(self, key: int) -> None:
        """Forgets `key`. Unknown keys are ignored."""
        if key in self:
            self._unlink(key)

    def _unlink(self, key: int) -> None:
        prev, nxt = self._prev, self._next
        before, after = prev[key], nxt[key]
        if before >= 0:
            nxt[before] = after
        else:
            self._head = after
        if after >= 0:
            prev[after] = before
        else:
            self._tail = before
        prev[key] = _OUT
        self._len -= 1

    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[int] | None:
        """Chooses the `n` least recent unprotected keys and forgets them."""
        if n == 1:
            key = self.evict_one(protected)
            return None if key is None else [key]
        nxt = self._next
        key = self._head
        victims: list[int] = []
        while key >= 0:
            if not protected(key):
                victims.append(key)
                if len(victims) == n:
                    break
            key = nxt[key]
        else:
            return None  # fewer than n: nothing changed
        for key in victims:
            self._unlink(key)
        return victims

    def evict_one(self, protected: Callable[[Hashable], bool]) -> int | None:
        """The least recent unprotected key, forgotten, or None: the hot path (see `EvictionPolicy`)."""
        nxt = self._next
        key = self._head
        while key >= 0:
            if not protected(key):
                prev = self._prev  # `_unlink(key)`, inlined
                before, after = prev[key], nxt[key]
                if before >= 0:
                    nxt[before] = after
                else:
                    self._head = after
                if after >= 0:
                    prev[after] = before
                else:
                    self._tail = before
                prev[key] = _OUT
                self._len -= 1
                return key
            key = nxt[key]
        return None

    def _grow(self, key: object) -> None:
        """Makes room for `key`, refusing anything but an integer >= 0."""
        if not isinstance(key, int) or key < 0:
            raise TypeError(f"SlotLRUPolicy tracks slot numbers (integers >= 0), got {key!r}")
        key = int(key)
        size = len(self._prev)
        if key < size:
            return
        more = max(key + 1, 2 * size, 16) - size
        self._prev.extend(array("i", [_OUT]) * more)
        self._next.extend(array("i", [_END]) * more)

    def __iter__(self) -> Iterator[int]:
        """The keys from least to most recent (the order `evict` takes them in, unprotected)."""
        key, nxt = self._head, self._next
        while key >= 0:
            yield key
            key = nxt[key]

    def __contains__(self, key: Hashable) -> bool:
        return key.__class__ is int and 0 <= key < len(self._prev) and self._prev[key] != _OUT

    def __len__(self) -> int:
        return self._len
