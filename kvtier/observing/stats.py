"""Counters the manager and the transfer engine update; read by `kvtier info`, the demo and metrics.

One `Stats` object is created by whoever owns the runtime and passed in; there are no globals.
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter
from dataclasses import dataclass, field

from kvtier.kinds import TierKind

# Upper bounds of the transfer latency histogram buckets, seconds (a last bucket catches the rest).
TRANSFER_BUCKETS_S = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


class DropReason:
    """Why a block left the cache entirely (strings so they print and export as labels)."""

    EVICTED = "evicted_from_last_tier"
    ADMISSION = "admission_rejected"
    LOWER_FULL = "lower_tiers_full"
    LOWER_DOWN = "lower_tiers_unavailable"  # evicted while every tier below was out of service
    NO_SPACE = "no_space"  # a store found no room in any tier
    BACKLOG = "store_backlog_full"  # a store that would have waited behind too many others
    STORE_FAILED = "store_io_error"
    DEMOTION_FAILED = "demotion_io_error"
    CHECKSUM = "checksum_error"
    READ_FAILED = "read_io_error"
    MOVE_ABORTED = "move_aborted"  # a cancelled move whose source had meanwhile been discarded
    SHARED_GONE = "shared_tier_lost_it"  # a lookup found the shared tier (the pool) no longer holding it
    # A failure reason, never a drop: the copy is in a tier that is down; it is kept for the tier's return.
    TIER_DOWN = "tier_unavailable"


def _per_tier() -> dict:
    return dict.fromkeys(TierKind, 0)


def _per_route() -> dict:
    return {(a, b): 0 for a in TierKind for b in TierKind if a is not b}


def _per_reason() -> dict:
    return {v: 0 for k, v in vars(DropReason).items() if not k.startswith("_")}


@dataclass
class Stats:
    """Event counts. Mutated under the runtime's lock; `snapshot()` copies them for readers.

    The counts the manager bumps per block (hits ... dropped) are plain dicts with every key there
    from the start (every tier, every route between two tiers, every drop reason), not `Counter`s:
    `d[k] += 1` on an exact dict takes the interpreter's fast path, which a dict subclass does
    not; at a few counts per block moved, that was ~5 % of a simulated replay. Readers see only
    the non-zero counts in `snapshot()`, as a `Counter` would show them.
    """

    hits: dict = field(default_factory=_per_tier)  # TierKind -> blocks served from that tier
    misses: int = 0
    stores: dict = field(default_factory=_per_tier)  # TierKind -> blocks written by a store
    evictions: dict = field(default_factory=_per_tier)  # TierKind -> copies evicted
    demotions: dict = field(default_factory=_per_route)  # (src, dst) -> completed demotions
    promotions: dict = field(default_factory=_per_route)  # (src, dst) -> completed promotions
    dropped: dict = field(default_factory=_per_reason)  # DropReason -> blocks lost
    checksum_errors: int = 0
    io_errors: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    prefetch_cancelled: int = 0
    prefetch_wasted: int = 0  # prefetched, then evicted before any load used it
    tier_failures: dict = field(default_factory=_per_tier)  # TierKind -> times taken out of the cascade
    tier_recoveries: dict = field(default_factory=_per_tier)  # TierKind -> times put back after a probe
    store_retries: int = 0  # blocks whose store failed in one tier and was tried again further down
    # TierKind -> blocks delivered from a copy in that tier after their read from another failed
    # (a load or promotion reading its plan's `Fallback`): served, where they would have missed
    fallback_reads: dict = field(default_factory=_per_tier)
    # A shared tier (the pool): "adopted" (blocks another process stored, found by a lookup here),
    # "asked" / "found" (keys sent to the tier's nodes by lookups, and found there), "negative_cached"
    # (misses answered from the short negative cache, no node asked), "deduplicated" (writes of a
    # block the pool already held: no bytes sent), "awaited_peer" (a write another process was
    # making of the same block at once, waited for instead), "left_to_peer" (writes a peer process
    # makes instead: `PoolTier.writes_shared`), "forgotten" (blocks the index listed on the shared
    # tier that a lookup found gone from it: evicted by the node, or its node lost)
    shared: Counter = field(default_factory=Counter)
    # Retention hints (`TierManager.apply_hint`): "applied", "refused:<reason>", "over_budget"
    # (blocks a retain_s left unprotected: the tenant's budget was spent), "session_blocks_over"
    # (blocks past a session's bound), "closed" (sessions closed), "sessions_forgotten" (least
    # recently used sessions dropped to make room for new ones), "doomed_evicted" (victims taken
    # first because every session that used them had closed)
    hints: Counter = field(default_factory=Counter)
    # (src, dst) -> [count per bucket of TRANSFER_BUCKETS_S, +inf], per block, submit to landed
    transfer_latency: dict = field(default_factory=dict)
    transfer_seconds: Counter = field(default_factory=Counter)  # (src, dst) -> summed seconds
    bytes_moved: Counter = field(default_factory=Counter)  # (src, dst) -> bytes
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add_bytes(self, src: str, dst: str, num_bytes: int) -> None:
        with self._lock:
            self.bytes_moved[(src, dst)] += num_bytes

    def count_shared(self, counts: dict[str, int]) -> None:
        with self._lock:
            for name, n in counts.items():
                if n:
                    self.shared[name] += n

    def observe_transfer(self, src: str, dst: str, seconds: float, num_blocks: int = 1) -> None:
        """Records that `num_blocks` blocks took `seconds` from submission to landing."""
        i = bisect.bisect_left(TRANSFER_BUCKETS_S, seconds)
        with self._lock:
            counts = self.transfer_latency.setdefault((src, dst), [0] * (len(TRANSFER_BUCKETS_S) + 1))
            counts[i] += num_blocks
            self.transfer_seconds[(src, dst)] += seconds * num_blocks

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def snapshot(self) -> dict[str, object]:
        """A JSON-ready copy of every counter."""
        def tiers(c: dict) -> dict[str, int]:
            return {TierKind(k).name.lower(): v for k, v in sorted(c.items()) if v}

        def pairs(c: dict) -> dict[str, int]:
            return {f"{_name(a)}->{_name(b)}": v for (a, b), v in sorted(c.items(), key=str) if v}

        with self._lock:
            return {
                "hits": tiers(self.hits), "misses": self.misses, "stores": tiers(self.stores),
                "evictions": tiers(self.evictions), "demotions": pairs(self.demotions),
                "promotions": pairs(self.promotions), "dropped": {k: v for k, v in self.dropped.items() if v},
                "checksum_errors": self.checksum_errors, "io_errors": self.io_errors,
                "tier_failures": tiers(self.tier_failures), "tier_recoveries": tiers(self.tier_recoveries),
                "store_retries": self.store_retries, "fallback_reads": tiers(self.fallback_reads), "shared": dict(sorted(self.shared.items())),
                "hints": dict(sorted(self.hints.items())),
                "prefetch": {"issued": self.prefetch_issued, "used": self.prefetch_used,
                             "cancelled": self.prefetch_cancelled, "wasted": self.prefetch_wasted},
                "bytes_moved": pairs(self.bytes_moved),
                "transfer_latency": {f"{_name(a)}->{_name(b)}": (list(c), self.transfer_seconds[(a, b)])
                                     for (a, b), c in sorted(self.transfer_latency.items(), key=str)},
            }


def _name(x: object) -> str:
    return TierKind(x).name.lower() if isinstance(x, int) else str(x)
