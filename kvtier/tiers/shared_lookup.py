"""What a shared tier (the pool) holds beyond this process's index: asked for, adopted, forgotten.

Other processes of the tenant store into the pool too, and the node evicts by its own recency, so
the index of one process is never the whole truth about the pool. `SharedLookup.leading(keys)`
asks the tier (one round trip, outside the runtime's lock) for the keys the index lacks and for
those only the pool serves here, adopts what it holds into the index, and forgets what it
dropped. It is the one place the runtime's `lookup` and `loadable` go through for that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Sequence

from kvtier.errors import TierIOError, TransferError
from kvtier.kinds import TierKind
from kvtier.deciding.manager import Move, TierManager
from kvtier.observing.stats import Stats
from kvtier.tiers.base import Tier
from kvtier.tiers.shared import SharedTier

log = logging.getLogger(__name__)


class SharedLookup:
    """Finds and adopts the blocks the shared tier `kind` holds.

    Args:
        kind, tier: the shared tier.
        manager: the runtime's manager; asked and changed only under `lock`.
        lock: the runtime's lock.
        stats: receives the count of copies forgotten.
        submit_moves: starts the moves an adoption triggers (caller holds the lock).
    """

    def __init__(self, kind: TierKind, tier: Tier, manager: TierManager, lock: threading.RLock, stats: Stats,
                 submit_moves: Callable[[Sequence[Move]], object]) -> None:
        self.kind, self.tier = kind, tier
        self._manager, self._lock, self._stats, self._submit_moves = manager, lock, stats, submit_moves

    def leading(self, keys: Sequence[Hashable]) -> int:
        """The leading run of `keys` that this process's tiers serve or the shared tier holds.

        The node evicts by its own recency and may have dropped a block this index still lists,
        which would otherwise be a hit at lookup and a failed load after it (for an engine, a
        forward pass computed and thrown away): those copies are forgotten (`forget_shared`).
        Blocks found are adopted into the index (each bound to the slot it got). A block indexed
        but not servable now (being stored) ends the run; a tier out of service is not asked."""
        with self._lock:
            here = self._manager.held_here(keys)
        end = len(here) if here and here[-1] is not None else len(here) - 1
        # Blocks it cannot share (private keys) are this process's own there: never asked for.
        ask = [i for i in range(end) if (here[i] is False or here[i] is self.kind) and self.tier.can_share(keys[i])]
        first_absent = next((i for i in range(end) if here[i] is False), end)
        if not ask or ask[0] > first_absent:
            return first_absent
        found = self._find([keys[i] for i in ask])
        if found is None:
            return ask[0]
        kept = self._forget([i for i, hit in zip(ask, found) if not hit and here[i] is self.kind], keys)
        run = min(next((i for i, hit in zip(ask, found) if not hit and i not in kept), end),
                  next((i for i in range(end) if here[i] is False and not self.tier.can_share(keys[i])), end))
        wanted = [i for i, hit in zip(ask, found) if hit and here[i] is False and i < run]
        if not wanted:
            return run
        adopted = self._adopt([keys[i] for i in wanted])
        # Adoption stops at the first key it cannot take (no slot, or indexed meanwhile): so does the run.
        return run if adopted == len(wanted) else wanted[adopted]

    def forward_hint(self, keys: Sequence[Hashable], *, retain_s: float | None, closed: bool) -> None:
        """Passes a hint the manager just applied on to the shared tier, for the keys it holds a
        copy of: those retained now (with `retain_s`) and, on `closed`, those doomed now. Caller
        holds the lock; the tier only queues (`SharedTier.hint`)."""
        if (retain_s is None and not closed) or not isinstance(self.tier, SharedTier):
            return
        retained, doomed = self._manager.hinted_copies(self.kind, keys)
        share = self.tier.can_share
        retain = [bytes(k) for k in retained if share(k)] if retain_s is not None else []
        release = [bytes(k) for k in doomed if share(k)] if closed else []
        if retain or release:
            self.tier.hint(retain, retain_s or 0.0, release)

    def _find(self, keys: list[Hashable]) -> list[bool] | None:
        """Whether the tier holds each key; None where it cannot be asked (out of service, closed,
        broken, refusing us now): its blocks count as misses."""
        if self.kind in self._manager.unavailable:
            return None
        try:
            return self.tier.find(keys)
        except (TierIOError, TransferError) as e:
            log.warning("kvtier: %s lookup failed, its blocks count as misses: %s", self.kind.name, e)
            return None

    def _forget(self, gone: list[int], keys: Sequence[Hashable]) -> set[int]:
        """Forgets the copies the tier no longer holds (at `gone`); returns those of them another
        tier here still serves (a tier that keeps what it holds, `Tier.may_drop` False): no miss."""
        kept: set[int] = set()
        if not gone:
            return kept
        with self._lock:
            forgotten = self._manager.forget_shared(self.kind, [keys[i] for i in gone])
            self._stats.count_shared({"forgotten": forgotten})
            for i in gone:
                now = self._manager.held_here([keys[i]])[0]
                if now is not None and now is not False:
                    kept.add(i)
        return kept

    def _adopt(self, keys: list[Hashable]) -> int:
        """Adopts `keys` into the index, each bound to the slot it got; how many were adopted."""
        with self._lock:
            adopted, moves = self._manager.adopt_shared(self.kind, keys)
            for key, slot in adopted:
                self.tier.bind(slot, key)
            self._submit_moves(moves)
        return len(adopted)
