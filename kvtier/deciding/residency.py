"""Which blocks became resident in which tier, and which left: a bounded log the manager appends to.

An engine that publishes KV events (vLLM's `BlockStored` / `BlockRemoved`, for a router that
scores prefixes by where they live) needs every change of what each tier can serve. The manager
knows it exactly, at the two points where a copy changes servability: a copy becomes READY, or a
READY copy leaves (a copy being written that fails was never servable, so it is never logged).
It appends `(op, tier, key)` here when a log is set (one `is not None` test otherwise); the
caller drains the log with `take` between engine steps.

HBM is not logged: the engine publishes its own pages' events (vLLM's `GPU` medium).

Bounded: a slow drainer costs memory up to `limit` entries for stores and `2 * limit` for
removals, then entries are dropped and counted, never waited for. Stores go first because a
router told too little (a block it does not know of) only misses a hit, while one told too
little of removals sends requests to a tier that no longer holds the block.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass, field

from kvtier.errors import ConfigError
from kvtier.kinds import TierKind


class ResidencyOp(enum.IntEnum):
    """What happened to a block's copy in a tier."""

    STORED = 0  # a copy became READY (stored, promoted into, demoted into, adopted)
    REMOVED = 1  # a READY copy left (evicted, demoted or promoted out of, found bad, gone from a shared tier)


STORED, REMOVED = ResidencyOp.STORED, ResidencyOp.REMOVED
_HBM = TierKind.HBM


@dataclass(frozen=True, slots=True)
class ResidencyBatch:
    """What `ResidencyLog.take` hands over: the entries in order, and what was dropped since the
    last take, by (tier, op)."""

    entries: tuple[tuple[ResidencyOp, TierKind, Hashable], ...] = ()
    dropped: dict[tuple[TierKind, ResidencyOp], int] = field(default_factory=dict)


class ResidencyLog:
    """A bounded log of (op, tier, key), in the order the manager made the changes.

    Args:
        limit: entries held before stores are dropped; removals are held up to twice as many.
    Raises:
        ConfigError: `limit` is not positive.
    """

    __slots__ = ("limit", "_entries", "_dropped")

    def __init__(self, limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise ConfigError(f"residency log limit: expected a positive number of entries, got {limit!r}")
        self.limit = limit
        self._entries: list[tuple[ResidencyOp, TierKind, Hashable]] = []
        self._dropped: dict[tuple[TierKind, ResidencyOp], int] = {}

    def append(self, op: ResidencyOp, tier: TierKind, key: Hashable) -> None:
        """Logs one change; an HBM copy is not logged, and one over the bound is counted instead."""
        if tier == _HBM:
            return
        entries = self._entries
        n = len(entries)
        if n >= self.limit and (op is STORED or n >= 2 * self.limit):
            self._dropped[tier, op] = self._dropped.get((tier, op), 0) + 1
            return
        entries.append((op, tier, key))

    def take(self) -> ResidencyBatch:
        """The entries logged and the drops counted since the last take; the log starts afresh."""
        entries, dropped = self._entries, self._dropped
        self._entries, self._dropped = [], {}
        return ResidencyBatch(tuple(entries), dropped)

    def __len__(self) -> int:
        return len(self._entries)
