"""Least-recently-used eviction: the default policy of every tier.

One `OrderedDict` ordered from least to most recent: insert, touch and remove are O(1); evicting
`n` victims walks from the least recent end and costs O(n + number of protected keys skipped).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

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
