"""Tiers out of service: which ones failed as a whole, and when to ask them again.

A tier that fails as a whole (`TierUnavailable`: its pool nodes do not answer, its device is gone)
is taken out of the manager's cascade at once, so that nothing more is stored in it, demoted into
it or served from it, and the blocks on their way there go on down instead. It is probed
(`Tier.probe`) after a backoff that doubles with every failed probe, up to a ceiling, and put back
as soon as a probe succeeds.

`TierHealth` is the bookkeeping, without I/O or threads (its clock is passed in); `HealthProber`
is the one thread that runs the probes, started when a tier first goes down; `TierService` is
what the runtime holds: both, wired to the manager through a callback.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.kinds import TierKind

if TYPE_CHECKING:
    from kvtier.moving.handle import Failure
    from kvtier.observing.stats import Stats
    from kvtier.tiers.base import Tier

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Down:
    since: float
    backoff_s: float
    probe_at: float
    error: str


class TierHealth:
    """Which tiers are down and when each is next probed.

    Args:
        clock: seconds, monotonic.
        first_backoff_s: the wait before the first probe of a tier that just failed.
        max_backoff_s: the ceiling the doubling wait stops at.
    """

    def __init__(self, clock: Callable[[], float], first_backoff_s: float = 0.5, max_backoff_s: float = 30.0) -> None:
        if not 0 < first_backoff_s <= max_backoff_s:
            raise ValueError(f"need 0 < first_backoff_s <= max_backoff_s, got {first_backoff_s}, {max_backoff_s}")
        self._clock, self.first_backoff_s, self.max_backoff_s = clock, first_backoff_s, max_backoff_s
        self._down: dict[TierKind, _Down] = {}
        self._recovered: dict[TierKind, tuple[float, float]] = {}  # tier -> (when, backoff it had reached)

    def failed(self, tier: TierKind, error: str) -> bool:
        """Notes that `tier` failed as a whole; True when this takes it down (it was up).

        A tier that fails again soon after it came back (within the ceiling) resumes its backoff
        where it was, doubled, rather than from the start: a tier that answers probes but fails
        real work is not retried twice a second forever.
        """
        if tier in self._down:
            return False
        now = self._clock()
        backoff = self.first_backoff_s
        back_at, reached = self._recovered.pop(tier, (None, 0.0))
        if back_at is not None and now - back_at < self.max_backoff_s:
            backoff = min(reached * 2, self.max_backoff_s)
        self._down[tier] = _Down(now, backoff, now + backoff, error)
        return True

    def due(self) -> list[TierKind]:
        """The down tiers whose probe time has come."""
        now = self._clock()
        return [t for t, d in self._down.items() if d.probe_at <= now]

    def probe_failed(self, tier: TierKind, error: str) -> None:
        """A probe of `tier` failed: the next one waits twice as long (up to the ceiling)."""
        d = self._down[tier]
        d.backoff_s = min(d.backoff_s * 2, self.max_backoff_s)
        d.probe_at = self._clock() + d.backoff_s
        d.error = error

    def recovered(self, tier: TierKind) -> float:
        """A probe of `tier` succeeded; returns how long it was down."""
        now, d = self._clock(), self._down.pop(tier)
        self._recovered[tier] = (now, d.backoff_s)
        return now - d.since

    def seconds_to_next_probe(self) -> float | None:
        """Until the earliest probe (0 when one is due); None when every tier is up."""
        if not self._down:
            return None
        return max(min(d.probe_at for d in self._down.values()) - self._clock(), 0.0)

    def facts(self) -> dict[str, dict[str, object]]:
        """Per down tier: for how long, the last error, seconds to the next probe."""
        now = self._clock()
        return {t.name.lower(): {"down_s": round(now - d.since, 3), "error": d.error,
                                 "next_probe_s": round(max(d.probe_at - now, 0.0), 3)}
                for t, d in self._down.items()}

    @property
    def down(self) -> frozenset[TierKind]:
        return frozenset(self._down)


class HealthProber:
    """The thread that probes down tiers when their time comes.

    Args:
        health: the bookkeeping; read and changed only under `lock`.
        lock: the runtime's lock.
        probe: runs one tier's probe (no lock held); raises while the tier cannot serve.
        on_recovered: called under `lock` when a probe succeeded.
    """

    def __init__(self, health: TierHealth, lock: threading.RLock, probe: Callable[[TierKind], None],
                 on_recovered: Callable[[TierKind], None]) -> None:
        self._health, self._lock, self._probe, self._on_recovered = health, lock, probe, on_recovered
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None

    def wake(self) -> None:
        """A tier just went down: start the thread if needed, and let it recompute its wait."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvtier-health", daemon=True)
            self._thread.start()
        self._wake.set()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop:
            with self._lock:
                wait_s = self._health.seconds_to_next_probe()
                due = self._health.due()
            if not due:
                self._wake.wait(wait_s)  # None: until a tier goes down
                self._wake.clear()
                continue
            for tier in due:
                self.probe(tier)

    def probe(self, tier: TierKind) -> bool:
        """Probes one down tier now (in the calling thread); True when it answered and is back."""
        try:
            self._probe(tier)
        except Exception as e:  # the tier is still down: it backs off; logged at debug, once per probe
            with self._lock:
                if tier in self._health.down:
                    self._health.probe_failed(tier, str(e))
            log.debug("tier %s still unavailable: %s", tier.name, e)
            return False
        with self._lock:
            if tier not in self._health.down:  # another probe brought it back meanwhile
                return False
            self._on_recovered(tier)
        return True


class TierService:
    """The runtime's side of tier health: takes a tier that failed as a whole out of service,
    probes it in the background (or at once, `recheck`) and puts it back.

    Args:
        tiers: the tiers, by kind (their `probe` is called).
        lock: the runtime's lock; `note` and the `set_available` callback run under it.
        set_available: takes a tier out of the cascade (False) or puts it back (True).
        stats: receives `tier_failures` and `tier_recoveries`.
        first_backoff_s, max_backoff_s: as `TierHealth`.
    """

    def __init__(self, tiers: Mapping[TierKind, Tier], lock: threading.RLock,
                 set_available: Callable[[TierKind, bool], None], stats: Stats,
                 first_backoff_s: float, max_backoff_s: float) -> None:
        self._set_available, self._stats, self._lock = set_available, stats, lock
        self._health = TierHealth(time.monotonic, first_backoff_s, max_backoff_s)
        self._back = threading.Condition(lock)  # notified when a tier returns to service
        self._prober = HealthProber(self._health, lock, lambda kind: tiers[kind].probe(), self._recovered)

    def note(self, tier: TierKind, failure: Failure) -> None:
        """Takes `tier` out of service if `failure` says it failed as a whole. Caller holds the lock."""
        if failure.unavailable and self._health.failed(tier, failure.error):
            self._stats.tier_failures[tier] += 1
            log.warning("%s tier unavailable, taken out of the cascade until it answers again: %s",
                        tier.name, failure.error)
            self._set_available(tier, False)
            self._prober.wake()

    def recheck(self) -> list[TierKind]:
        """Probes every tier out of service now; returns those back in service."""
        with self._lock:
            down = sorted(self._health.down)
        return [tier for tier in down if self._prober.probe(tier)]

    def wait(self, timeout_s: float | None = None) -> bool:
        """Waits until every tier is in service; False if some tier is still out after `timeout_s`."""
        with self._back:
            return self._back.wait_for(lambda: not self._health.down, timeout_s)

    def facts(self) -> dict[str, dict[str, object]]:
        """As `TierHealth.facts`. Caller holds the lock."""
        return self._health.facts()

    def close(self) -> None:
        self._prober.close()

    def _recovered(self, tier: TierKind) -> None:
        down_s = self._health.recovered(tier)
        self._stats.tier_recoveries[tier] += 1
        log.warning("%s tier answers again after %.1f s: back in the cascade", tier.name, down_s)
        self._set_available(tier, True)
        self._back.notify_all()
