"""The `EvictionPolicy` interface: who leaves a tier when it must make room.

Policies are pure bookkeeping over opaque hashable keys: no I/O, no clocks, no knowledge of tiers.
They are atomic: `evict(n, protected)` returns exactly `n` victims or None, and on None nothing
changed. Every implementation passes `kvtier.testing.policy_contract` unchanged.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable


class HintKind(enum.Enum):
    """What a request's hint said about a key (see kvtier.deciding.retention)."""

    RETAINED = "retained"  # kept for a while, in the last tier
    CLOSED = "closed"  # every session that used it has ended: it is worth little now


class EvictionPolicy(ABC):
    """Orders the keys resident in one tier by how much they deserve to stay."""

    # Whether the manager should call `note_hint` (it does only where this is True).
    notes_hints = False

    def note_hint(self, key: Hashable, kind: HintKind) -> None:
        """Told by the manager what a hint said of a resident `key`; unknown keys are ignored.

        Optional: the manager already evicts doomed keys first and protects retained ones itself,
        so a policy need not act on it. The default does nothing.
        """

    @abstractmethod
    def insert(self, key: Hashable) -> None:
        """Records that `key` became resident.

        Raises:
            KeyError: `key` is already tracked.
        """

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """Records an access to a resident `key`. Unknown keys are ignored (a miss is not an error)."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """Forgets `key` (it left the tier for a reason other than eviction). Unknown keys are ignored."""

    def evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """Chooses `n` victims, none for which `protected(key)` is true, and forgets them.

        Args:
            n: number of victims wanted (>= 0).
            protected: keys that must stay (pinned, being read or written); they keep their place.
        Returns:
            Exactly `n` victims in eviction order, or None when fewer than `n` unprotected keys
            exist; on None the policy's state is unchanged.
        Raises:
            ValueError: `n` is negative.
            Exception: whatever `protected` raises; the policy's state is unchanged by then.
        """
        if n < 1:
            if n < 0:
                raise ValueError(f"evict: n must be >= 0, got {n}")
            return []
        if n > len(self):
            return None
        return self._evict(n, protected)

    def evict_one(self, protected: Callable[[Hashable], bool]) -> Hashable | None:
        """`evict(1, protected)`'s victim, or None where there is none: the manager's per-block
        path (once per block stored into a full tier), without the list."""
        victims = self.evict(1, protected) if len(self) else None
        return victims[0] if victims else None

    @abstractmethod
    def _evict(self, n: int, protected: Callable[[Hashable], bool]) -> list[Hashable] | None:
        """`evict` once its arguments are checked: 1 <= n <= len(self)."""

    @abstractmethod
    def __contains__(self, key: Hashable) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...
