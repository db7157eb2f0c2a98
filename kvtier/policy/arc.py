"""Adaptive Replacement Cache (Megiddo & Modha, FAST'03).

Resident keys live in T1 (seen once recently) or T2 (seen at least twice); B1 and B2 remember keys
recently evicted from T1 and T2. A ghost hit on insert moves the target size `p` of T1: a B1 hit
means T1 was too small (p grows), a B2 hit means T2 was (p shrinks). Eviction takes T1's least
recent key while |T1| > p, else T2's.

Differences from the paper, forced by the `EvictionPolicy` split between evict and insert:
residency is decided by the tier, so `capacity_hint` (the paper's c) only bounds the ghost lists
(|T1| + |B1| <= c, all four lists <= 2c) and p; and the paper's tie-break "evict from T1 when
|T1| == p and the incoming key is in B2" is dropped, since eviction happens before the incoming key
is known. Eviction depends only on list sizes and p, neither of which it changes until it commits,
so `evict` plans its victims without touching anything and is atomic for free.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator

from kvtier._keytable import KeyList
from kvtier.errors import ConfigError
from kvtier.policy.base import EvictionPolicy

# Least recent first. A KeyList (C) does what an OrderedDict of key -> None did, with nothing per
# key for the garbage collector to walk (the four lists hold up to twice the tier's keys).
_List = KeyList


class ARCPolicy(EvictionPolicy):
    """Balances recency (T1) against frequency (T2), adapting the split from ghost hits."""

    def __init__(self, capacity_hint: int) -> None:
        """Creates an empty policy.

        Args:
            capacity_hint: expected number of resident keys (the paper's c); bounds the ghost
                lists and the target size p of T1.
        Raises:
            ConfigError: `capacity_hint` is not an integer >= 1.
        """
        is_int = isinstance(capacity_hint, int) and not isinstance(capacity_hint, bool)
        if not is_int or capacity_hint < 1:
            raise ConfigError(f"arc.capacity_hint must be an integer >= 1, got {capacity_hint!r}")
        self._capacity = capacity_hint
        self._p = 0
        self._t1: _List = KeyList()
        self._t2: _List = KeyList()
        self._b1: _List = KeyList()
        self._b2: _List = KeyList()

    @property
    def target_t1(self) -> int:
        """The current target size p of T1 (0 <= p <= capacity_hint); exposed for stats."""
        return self._p

    def insert(self, key: Hashable) -> None:
        """Records that `key` became resident: into T2 on a ghost hit (adapting p), else into T1.

        Raises:
            KeyError: `key` is already tracked.
        """
        if key in self._t1 or key in self._t2:
            raise KeyError(key)
        if key in self._b1:
            self._p = min(self._capacity, self._p + max(1, len(self._b2) // len(self._b1)))
            del self._b1[key]
            self._t2[key] = None
        elif key in self._b2:
            self._p = max(0, self._p - max(1, len(self._b1) // len(self._b2)))
            del self._b2[key]
            self._t2[key] = None
        else:
            self._t1[key] = None
            if self._b1 or self._b2:  # nothing to trim otherwise
                self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        """Makes a resident `key` the most recent of T2. Unknown keys are ignored."""
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
        elif key in self._t1:
            del self._t1[key]
            t2[key] = None

    def remove(self, key: Hashable) -> None:
        """Forgets `key` without remembering it as a ghost. Unknown keys are ignored."""
        if self._t1.pop(key, _MISSING) is _MISSING:
            self._t2.pop(key, None)

    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Chooses `n` victims by the ARC rule and moves them to the ghost lists."""
        if n == 1:
            key = self.evict_one(protected)
            return None if key is None else [key]
        plan = self._plan(n, protected)
        if plan is None:
            return None
        return self._commit(plan)

    def evict_one(self, protected: Callable[[Hashable], bool]) -> Hashable | None:
        """`evict(1, protected)`'s victim, or None: the hot path of a full tier, without the plan."""
        t1, t2 = self._t1, self._t2
        for keys in ((t1, t2) if len(t1) > self._p else (t2, t1)):
            for key in keys:
                if not protected(key):
                    del keys[key]  # ends the loop: the iterator is not advanced again
                    (self._b1 if keys is t1 else self._b2)[key] = None
                    self._trim_ghosts()
                    return key
        return None

    def _plan(
        self, n: int, protected: Callable[[Hashable], bool]
    ) -> list[tuple[bool, Hashable]] | None:
        """Returns `n` (from_t1, key) victims in order without changing anything, or None."""
        from_t1 = _Unprotected(self._t1, protected)
        from_t2 = _Unprotected(self._t2, protected)
        num_t1 = len(self._t1)
        plan: list[tuple[bool, Hashable]] = []
        while len(plan) < n:
            prefer_t1 = num_t1 > self._p
            first, second = (from_t1, from_t2) if prefer_t1 else (from_t2, from_t1)
            source = first if first.peek() is not _MISSING else second
            key = source.take()
            if key is _MISSING:
                return None
            is_t1 = source is from_t1
            num_t1 -= is_t1
            plan.append((is_t1, key))
        return plan

    def _commit(self, plan: list[tuple[bool, Hashable]]) -> list[Hashable]:
        """Moves the planned victims from T1/T2 to the most recent end of B1/B2."""
        keys: list[Hashable] = []
        for is_t1, key in plan:
            if is_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
            keys.append(key)
        self._trim_ghosts()
        return keys

    def _trim_ghosts(self) -> None:
        """Drops the oldest ghosts until |T1| + |B1| <= c and all four lists hold <= 2c keys."""
        c = self._capacity
        b1, b2 = self._b1, self._b2
        num_t1, num_b1 = len(self._t1), len(b1)
        while num_b1 and num_t1 + num_b1 > c:
            b1.popitem(last=False)
            num_b1 -= 1
        excess = num_t1 + len(self._t2) + num_b1 + len(b2) - 2 * c
        while excess > 0 and (b1 or b2):
            (b2 or b1).popitem(last=False)
            excess -= 1

    def __contains__(self, key: Hashable) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


_MISSING = object()  # no key left
_UNSEEN = object()  # cursor has not looked for its next key yet


class _Unprotected:
    """A read-only cursor over one list's unprotected keys, least recent first; looks one ahead."""

    __slots__ = ("_keys", "_protected", "_head")

    def __init__(self, keys: _List, protected: Callable[[Hashable], bool]) -> None:
        self._keys: Iterator[Hashable] = iter(keys)
        self._protected = protected
        self._head: object = _UNSEEN

    def peek(self) -> object:
        """Returns the next unprotected key without consuming it, or _MISSING when none is left."""
        if self._head is _UNSEEN:
            self._head = _MISSING
            for key in self._keys:
                if not self._protected(key):
                    self._head = key
                    break
        return self._head

    def take(self) -> object:
        """Returns and consumes the next unprotected key, or _MISSING when none is left."""
        key = self.peek()
        if key is not _MISSING:
            self._head = _UNSEEN
        return key
