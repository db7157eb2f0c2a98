"""Least-recently-used eviction: the default policy of every tier.

Two implementations of one order:
  * `SlotLRUPolicy`, what `make_policy` builds for the manager, which hands its policies slot
    numbers (`tracks_slots`): a doubly linked list threaded through two arrays indexed by slot
    (4 bytes a link), oldest at the head, kept in C (`kvtier._keytable.SlotList`: each verb is one
    C call, ten times cheaper than a Python method, and LRU runs once or twice per block moved).
    Nothing per key is an object, so a full garbage collection has nothing to walk (see
    kvtier.deciding.index); keys must be integers >= 0, dense as slot numbers are (the arrays grow to the
    largest seen); a bool counts as 0 or 1.
  * `LRUPolicy`, for any hashable keys: one `OrderedDict` ordered from least to most recent, which
    keeps a node per key.
Both: insert, touch and remove are O(1); evicting `n` victims walks from the least recent end and
costs O(n + number of protected keys skipped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator

from kvtier._keytable import SlotList
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


class SlotLRUPolicy(SlotList, EvictionPolicy):
    """`LRUPolicy` over integer keys (slot numbers): see the module's docstring.

    Its verbs are the C base's (`kvtier._keytable.SlotList`), called with no Python frame: insert
    (KeyError if tracked, TypeError unless an integer in [0, 2**31 - 2)), touch and remove (unknown
    keys ignored), evict_one and _evict (`protected` must not change the policy: RuntimeError), and
    iteration from least to most recent (a snapshot). `SlotLRUPolicy(capacity_hint)` sizes the arrays.
    """

    __slots__ = ()
    tracks_slots = True  # the manager may hand it slot numbers as they are
